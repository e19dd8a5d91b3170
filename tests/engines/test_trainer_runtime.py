"""`TrainerRuntime` (service/core/runtime.py): every engine call runs on its one thread, calls from other threads
are queued and waited for, and after a shutdown a call is refused with a retryable UNAVAILABLE. A real
`TorchTrainerEngine` on the tiny model; no server."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from together_train_server.engines.torch_trainer import TorchTrainerEngine
from together_train_server.engines.types import AdamParams, LoraConfig, Sample
from together_train_server.service.core.operations import OperationBook
from together_train_server.service.core.runtime import TrainerRuntime
from together_train_server.service.errors import ServiceError


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return TorchTrainerEngine(tiny_model_dir)


def test_engine_calls_run_on_the_runtime_thread_one_at_a_time(engine):
    rt = TrainerRuntime(engine, OperationBook())
    try:
        assert rt.call(lambda: threading.current_thread().name) == "trainer-runtime"
        assert rt.create_adapter("a", LoraConfig(rank=2, alpha=4.0)) > 0   # from this thread: queued, waited for
        running, overlaps, results = [0], [], []
        lock = threading.Lock()

        def work(i: int) -> int:
            with lock:
                running[0] += 1
                overlaps.append(running[0])
            out = rt.step("a") + i   # re-entrant on the runtime's thread: runs at once
            with lock:
                running[0] -= 1
            return out

        threads = [threading.Thread(target=lambda i=i: results.append(rt.call(lambda: work(i)))) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(results) == list(range(6)) and max(overlaps) == 1, (results, overlaps)
        s = Sample(model_input=np.arange(1, 9, dtype=np.int64), inputs={"target_tokens": np.arange(2, 10, dtype=np.int64),
                                                                      "weights": np.ones(8, dtype=np.float32)})
        alone = rt.forward("a", [s], "cross_entropy", backward=True)
        assert np.isfinite(alone.loss)
        assert rt.optim_step("a", AdamParams(learning_rate=1e-3)).step == 1 == rt.step("a")
        rt.drop_adapter("a")
        with pytest.raises(KeyError):
            rt.step("a")
    finally:
        rt.close()


def test_a_call_after_shutdown_is_refused_unavailable(engine):
    rt = TrainerRuntime(engine, OperationBook())
    rt.close()
    with pytest.raises(ServiceError) as e:
        rt.create_adapter("late", LoraConfig(rank=2))
    assert e.value.code == "UNAVAILABLE" and e.value.retryable, e.value
    assert "late" not in getattr(engine, "_adapters", {})   # nothing ran


def test_capabilities_are_read_once_when_built(engine):
    """The runtime takes the engine's declaration: paging and the clock cycle are set up from it."""
    rt = TrainerRuntime(engine, OperationBook())
    try:
        assert rt.capabilities is TorchTrainerEngine.capabilities
        from together_train_server.service.training.cycle import ClockCycle

        assert rt.use_cycle(lambda r: ClockCycle(r, None)) is True   # type: ignore[arg-type]
        assert isinstance(rt.cycle, ClockCycle) and rt.cycle.runtime is rt
    finally:
        rt.close()
