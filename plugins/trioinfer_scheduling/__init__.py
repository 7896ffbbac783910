"""First-party scheduler plugins (entry-point group ``trioinfer.schedulers``).

- `fifo`: [`FifoScheduler`][trioinfer_scheduling.FifoScheduler], in the order admitted.
- `priority`: [`PriorityScheduler`][trioinfer_scheduling.PriorityScheduler], by
  priority level, then admission; aging bounds how long lower levels wait.
- `deadline`: [`DeadlineScheduler`][trioinfer_scheduling.DeadlineScheduler], by
  the caller's deadline, earliest first; optionally refuses hopeless requests.
- `fair`: [`FairScheduler`][trioinfer_scheduling.FairScheduler], a weighted fair
  share of rows per tenant.

Each imports only the public ``trioinfer`` API and passes
[`check_scheduler()`][trioinfer.testing.check_scheduler].
"""

from __future__ import annotations

from ._deadline import DeadlineScheduler as DeadlineScheduler
from ._fair import FairScheduler as FairScheduler
from ._fifo import FifoScheduler as FifoScheduler
from ._priority import PriorityScheduler as PriorityScheduler

__all__ = ["DeadlineScheduler", "FairScheduler", "FifoScheduler", "PriorityScheduler"]
