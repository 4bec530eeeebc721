"""What the ranks of a multi-rank training job agree on at a step boundary.

Only rank 0 talks to the sidecar. At every boundary rank 0 broadcasts one int64 ("which update
is newest"); only when it differs from the one in force does it broadcast the update itself
(``broadcast_object_list``), so every rank switches at the same step. A new config's shadow
verdict is agreed by all ranks (one all-reduce per new config): it fails on every rank when it
fails on one, since the ranks run one config.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from tuner.job._lease_client import LeaseUpdate


class RankSync:
    """The collectives of the session's boundary; made once the process group is up."""

    def __init__(self) -> None:
        self._device = (torch.device("cuda", torch.cuda.current_device())
                        if dist.get_backend() == "nccl" else torch.device("cpu"))

    def newest(self, update: LeaseUpdate | None, applied_seq: int) -> LeaseUpdate | None:
        """Rank 0's ``update`` on every rank; None when it is the one in force already."""
        seq = update.seq if update is not None else applied_seq
        flag = torch.tensor([seq], dtype=torch.int64, device=self._device)
        dist.broadcast(flag, src=0)
        if int(flag.item()) == applied_seq:
            return None
        box: list[Any] = [update]
        dist.broadcast_object_list(box, src=0)
        return box[0]  # type: ignore[no-any-return]

    def agree(self, error: str | None) -> str | None:
        """This rank's error, or one saying another rank failed; None when all passed."""
        flag = torch.tensor([error is not None], dtype=torch.int64, device=self._device)
        dist.all_reduce(flag)
        if error is None and int(flag.item()):
            return "failed on another rank"
        return error
