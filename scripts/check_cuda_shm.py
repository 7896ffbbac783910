"""Check CUDA shared memory on a GPU machine: another process's device memory, read and written.

A child process allocates device memory with the CUDA driver API (ctypes, no
package needed), fills it and hands out its IPC handle, as a Triton client
does with ``cuda_shared_memory``; this process registers it in the server's
registry (`trioinfer.server._shm`), reads an input from it through a lease,
writes an output into it, and the child checks what landed on the device.
Where trioinfer's own dependencies cannot be imported, the driver layer
(`_cuda_ipc`) is checked alone, loaded from its file.

Usage:  python scripts/check_cuda_shm.py      (exit status 0: checked)
"""

from __future__ import annotations

import base64
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZE = 64 * 4

CHILD = r"""
import base64, ctypes, sys
lib = ctypes.CDLL("libcuda.so.1")
def ok(code, what):
    if code != 0:
        raise SystemExit(f"{what} failed: {code}")
ok(lib.cuInit(0), "cuInit")
dev = ctypes.c_int(); ok(lib.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ctx = ctypes.c_void_p(); ok(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "retain")
ok(lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
ptr = ctypes.c_uint64(); ok(lib.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(SIZE)), "alloc")
data = bytes(range(256))[:SIZE]
ok(lib.cuMemcpyHtoD_v2(ptr, ctypes.c_char_p(data), ctypes.c_size_t(SIZE)), "HtoD")
handle = (ctypes.c_char * 64)()
ok(lib.cuIpcGetMemHandle(handle, ptr), "cuIpcGetMemHandle")
print(base64.b64encode(bytes(handle)).decode(), flush=True)
sys.stdin.readline()  # the parent has written
out = (ctypes.c_char * SIZE)()
ok(lib.cuMemcpyDtoH_v2(out, ptr, ctypes.c_size_t(SIZE)), "DtoH")
print("child sees", bytes(out)[:8].hex(), flush=True)
""".replace("SIZE", str(SIZE))


def main() -> int:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None
    assert child.stdout is not None
    raw = base64.b64decode(child.stdout.readline().strip())
    expected = bytes(range(256))[:SIZE]
    sys.path.insert(0, str(ROOT / "src"))
    try:
        from trioinfer.server._shm import SystemSharedMemory
    except ImportError as exc:
        print(f"trioinfer cannot be imported here ({exc}); checking _cuda_ipc alone")
        spec = importlib.util.spec_from_file_location(
            "_cuda_ipc", ROOT / "src" / "trioinfer" / "server" / "_cuda_ipc.py"
        )
        assert spec is not None
        assert spec.loader is not None
        ipc = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ipc)
        print("probe:", ipc.probe())
        memory = ipc.IpcMemory(raw, 0)
        got = bytes(memory.read(0, SIZE))
        memory.write(0, b"\xff" * 8)
        memory.close()
    else:
        registry = SystemSharedMemory()
        registry.register_cuda("gpu", raw, 0, SIZE)
        print("status:", registry.cuda_status())
        with registry.lease() as lease:
            got = bytes(lease.read("gpu", 0, SIZE))
            lease.write("gpu", 0, 8, [b"\xff" * 8])
            try:
                lease.read("gpu", SIZE - 4, 8)
            except Exception as exc:
                print("out of range refused:", exc)
        registry.unregister_cuda()
        print("after unregister:", registry.cuda_status())
    print("read matches:", got == expected)
    child.stdin.write("go\n")
    child.stdin.flush()
    line = child.stdout.readline().strip()
    print(line)
    child.wait()
    good = got == expected and line == "child sees " + "ff" * 8
    print("PASS" if good else "FAIL")
    return 0 if good else 1


if __name__ == "__main__":
    raise SystemExit(main())
