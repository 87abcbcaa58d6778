"""The GPU's clocks, power, temperature and clock limits at a moment, read through NVML.

A latency-bound decode step runs at the SM clock: on a shared GPU the same graph can
replay a few percent apart from one minute to the next, and a timing cannot say why
unless it records the state the device ran it in. The benchmarks
sample it right after each timing. NVML comes from ``pynvml`` (the ``nvidia-ml-py``
package, in the ``cuda`` extra); without it, without a driver or on CPU there is no
sample (None) and the timings are the same.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

# NVML's clock-limit ("throttle" / "event") reason bits, stable across driver versions
LIMIT_REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}


def limit_reasons(mask: int) -> list[str]:
    """The names of the reasons set in an NVML clock-limit bit mask (unknown bits as hex)."""
    names = [name for bit, name in LIMIT_REASONS.items() if mask & bit]
    rest = mask & ~sum(LIMIT_REASONS)
    return names + ([hex(rest)] if rest else [])


def _handle(nvml: Any, device: torch.device) -> Any:
    """The NVML handle of a CUDA device, matched by UUID (CUDA and NVML may number GPUs apart)."""
    want = f"GPU-{torch.cuda.get_device_properties(device).uuid}"
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        if (uuid.decode() if isinstance(uuid, bytes) else uuid) == want:
            return handle
    raise LookupError(f"NVML lists no GPU with UUID {want}")


def gpu_state(device: torch.device) -> Optional[dict[str, Any]]:
    """SM and memory clocks (MHz), power (W), temperature (C) and the reasons the clocks are
    held below their maximum, of a CUDA ``device`` now; None where NVML cannot tell."""
    if device.type != "cuda":
        return None
    try:
        import pynvml as nvml
    except ImportError:
        return None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:  # no driver
        return None
    try:
        handle = _handle(nvml, device)
        reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) \
            or nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        return {
            "sm_clock_mhz": nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
            "mem_clock_mhz": nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM),
            "power_w": nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0,
            "temperature_c": nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
            "clock_limits": limit_reasons(int(reasons(handle))),
        }
    except (nvml.NVMLError, LookupError):  # a GPU NVML does not show, a query it refuses
        return None
    finally:
        nvml.nvmlShutdown()
