"""SlotPool: the fixed set of per-call resources an engine backend holds (static caches, execution contexts);
EngineBackend: what the engine backends (static, trt) share: torch buffers, a slot per runner, the engines'
capacity as the context limit.

A runner takes a slot for its lifetime (Runner.close gives it back); further callers wait for one. A caller
that already holds every slot and asks for another (a model drafting for itself with one slot) is refused
with what to rebuild, instead of waiting forever.
"""

from __future__ import annotations

import threading

from specrt.errors import InvalidRequestError
from specrt.runtime.backends.base import Backend, torch_head, torch_pick, torch_wait


class SlotPool:
    def __init__(self, slots: list, role: str, rebuild: str):
        self._slots = slots
        self._holders: list[int | None] = [None] * len(slots)  # thread id of the runner's creator while held
        self._role, self._rebuild = role, rebuild  # for the refusal: whose engines, and the command to rebuild
        self._free = threading.Condition()

    def __iter__(self):
        return iter(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def acquire(self):
        me = threading.get_ident()
        with self._free:
            while True:
                if None in self._holders:
                    i = self._holders.index(None)
                    self._holders[i] = me
                    return self._slots[i]
                if me in self._holders:
                    raise InvalidRequestError(f"the {self._role}'s engines have {len(self._slots)} slot(s) and this call "
                                              f"holds them all (a model drafting for itself needs two): rebuild with "
                                              f"`{self._rebuild} --slots 2`")
                self._free.wait()

    def release(self, slot) -> None:
        with self._free:
            self._holders[next(i for i, s in enumerate(self._slots) if s is slot)] = None
            self._free.notify()


class EngineBackend(Backend):
    """A backend over built engines (self.engines: an EngineSet), on torch buffers (self.torch, self.dtype,
    self.device), whose runners each hold one of self._slots (a SlotPool) for their lifetime."""

    @property
    def max_context(self) -> int:
        return self.engines.capacity

    def allocate(self, shape):
        return self.torch.zeros(shape, dtype=self.dtype, device=self.device)

    _wait = torch_wait
    _head = staticmethod(torch_head)  # the engines' logits stay on the device; the head reduces them there
    host_logits = False

    def _pick(self, logits, pick):
        return torch_pick(self.torch, logits, pick)

    def _new_binding(self):
        return self._slots.acquire()

    def _release(self, slot) -> None:
        self._slots.release(slot)
