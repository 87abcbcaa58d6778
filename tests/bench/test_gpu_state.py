"""``gpu_state`` reads clocks, power, temperature and clock limits through NVML; checked against a
stand-in ``pynvml`` whose answers are set by hand (no GPU here)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from ingot.bench import gpu_state as gs

UUID = "0c1f7e2a-5b3d-4e8f-9a6b-1c2d3e4f5a6b"


class FakeNVMLError(Exception):
    pass


def fake_nvml(uuids: list[str], fail_init: bool = False, event_reasons: bool = True) -> types.ModuleType:
    """A ``pynvml`` listing GPUs with these UUIDs; GPU i answers clocks 1000+i / 3201 MHz, 350,500 mW,
    40 C, limits sw_power_cap | hw_thermal. Records init / shutdown calls."""
    m = types.ModuleType("pynvml")
    m.NVMLError = FakeNVMLError
    m.NVML_CLOCK_SM, m.NVML_CLOCK_MEM, m.NVML_TEMPERATURE_GPU = 1, 2, 0
    m.calls = []

    def init():
        m.calls.append("init")
        if fail_init:
            raise FakeNVMLError("no driver")

    m.nvmlInit = init
    m.nvmlShutdown = lambda: m.calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: len(uuids)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetUUID = lambda h: f"GPU-{uuids[h]}".encode()  # older releases answer bytes
    m.nvmlDeviceGetClockInfo = lambda h, kind: {1: 1000 + h, 2: 3201}[kind]
    m.nvmlDeviceGetPowerUsage = lambda h: 350_500
    m.nvmlDeviceGetTemperature = lambda h, sensor: 40 if sensor == 0 else -1
    reasons = lambda h: 0x4 | 0x40  # noqa: E731
    if event_reasons:
        m.nvmlDeviceGetCurrentClocksEventReasons = reasons
    else:
        m.nvmlDeviceGetCurrentClocksThrottleReasons = reasons
    return m


@pytest.fixture
def cuda_props(monkeypatch):
    """torch sees one CUDA device with UUID ``UUID``."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid=UUID))


@pytest.mark.parametrize("event_reasons", [True, False])
def test_reads_the_gpu_whose_uuid_torch_reports(monkeypatch, cuda_props, event_reasons):
    nvml = fake_nvml(["ffffffff-0000-0000-0000-000000000000", UUID], event_reasons=event_reasons)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    state = gs.gpu_state(torch.device("cuda", 0))
    # NVML's second GPU is CUDA's device 0 here
    assert state == {"sm_clock_mhz": 1001, "mem_clock_mhz": 3201, "power_w": 350.5, "temperature_c": 40,
                     "clock_limits": ["sw_power_cap", "hw_thermal"]}
    assert nvml.calls == ["init", "shutdown"]


def test_none_without_nvml_driver_or_match(monkeypatch, cuda_props):
    assert gs.gpu_state(torch.device("cpu")) is None
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import fails
    assert gs.gpu_state(torch.device("cuda")) is None
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml([UUID], fail_init=True))
    assert gs.gpu_state(torch.device("cuda")) is None
    nvml = fake_nvml(["ffffffff-0000-0000-0000-000000000000"])  # NVML does not show torch's GPU
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert gs.gpu_state(torch.device("cuda")) is None
    assert nvml.calls == ["init", "shutdown"]


def test_limit_reasons_by_hand():
    assert gs.limit_reasons(0) == []
    assert gs.limit_reasons(0x1) == ["gpu_idle"]
    assert gs.limit_reasons(0x4 | 0x20 | 0x80) == ["sw_power_cap", "sw_thermal", "hw_power_brake"]
    assert gs.limit_reasons(0x4 | 0x1000) == ["sw_power_cap", "0x1000"]
