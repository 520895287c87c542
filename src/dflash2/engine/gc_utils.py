"""Python's cyclic collector in a serving process. A full collection walks every object it tracks, and
what a server holds for good (the models' modules and parameters, the libraries' code, the graphs) is
most of them: in the embedded server on the CPU ~400,000 objects and 185 ms a full collection, a pause of
every running request; on the H100 a benchmark's full collection paused a timed round for ~0.67 s
(docs/benchmarks.md, forty-eighth session). So, as vLLM (``freeze_gc_heap``) and SGLang (``freeze_gc``)
do once start-up is over, what is alive then moves to the permanent generation (:func:`freeze_gc`), and
the pauses are measured where the server shows them (:class:`GCPauses`, ``/metrics``)."""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("dflash2.gc")


class GCPauses:
    """A ``gc.callbacks`` entry: the seconds spent in collections and their count by generation; with
    ``warn_after_s`` > 0, each collection that took at least that long is logged (SGLang's
    ``--gc-warning-threshold-secs``)."""

    def __init__(self, warn_after_s: float = 0.0):
        if warn_after_s < 0:
            raise ValueError(f"--gc-warning-threshold-secs must be >= 0, got {warn_after_s}")
        self.warn_after_s = warn_after_s
        self.seconds, self.count, self._start = 0.0, [0, 0, 0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        took = time.perf_counter() - self._start
        self.seconds += took
        self.count[info["generation"]] += 1
        if 0 < self.warn_after_s <= took:
            log.warning(
                "a generation-%d garbage collection took %.3f s (%d objects freed; %d frozen out of its walks)",
                info["generation"],
                took,
                info.get("collected", 0),
                gc.get_freeze_count(),
            )


def freeze_gc(context: str) -> int:
    """Collect, then move every object alive into the permanent generation, which no later collection
    walks; returns how many moved. Call it once what lives for good is built (after the warm-up).
    Frozen objects that die later are still freed by reference counting; only cycles among them wait
    for :func:`gc.unfreeze`."""
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    n = gc.get_freeze_count()
    log.info("%s: %d objects frozen out of the collector's walks (%.2f s)", context, n, time.perf_counter() - t)
    return n
