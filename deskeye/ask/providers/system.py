"""System figures from psutil: battery, CPU, memory, disk — "battery level?", "内存用了多少", "system status"."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from deskeye.ask.providers.base import QueryContext, has_text, has_word

NAME = "system"
LABEL, LABEL_ZH = "The system figures", "系统信息"     # who "did not answer" when it is too slow
CPU_SAMPLE_S = 0.2      # cpu_percent measures over this window (a first call has no earlier sample)
GIB = 1024 ** 3

_BATTERY = (("battery", "batery", "charging", "charge", "plugged", "power"),
            ("电池", "电量", "充电", "剩多少电", "还有多少电"))
_CPU = (("cpu", "processor", "load", "cores"), ("cpu", "处理器", "负载"))
_MEMORY = (("memory", "ram", "swap"), ("内存",))
_DISK = (("disk", "disks", "storage", "drive", "space", "ssd", "hdd"), ("磁盘", "硬盘", "存储", "空间"))
_GENERAL = (("system", "computer", "laptop", "machine", "pc"), ("系统", "电脑", "机器"))


@dataclass(frozen=True)
class SystemFigures:
    cpu_percent: float | None = None
    num_cpus: int | None = None
    load_1min: float | None = None
    memory_percent: float | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    memory_available_bytes: int | None = None
    disk_path: str = ""
    disk_percent: float | None = None
    disk_free_bytes: int | None = None
    disk_total_bytes: int | None = None
    has_battery: bool | None = None
    battery_percent: float | None = None
    battery_plugged: bool | None = None
    battery_secs_left: int | None = None


def _asks(query: str, words) -> bool:
    return has_word(query, words[0]) or has_text(query, words[1])


def matches_figure(query: str) -> bool:
    """Names a figure (battery, CPU, memory, disk): wins over the calendar ("how busy is the CPU")."""
    return any(_asks(query, words) for words in (_BATTERY, _CPU, _MEMORY, _DISK))


def matches(query: str) -> bool:
    return matches_figure(query) or _asks(query, _GENERAL)


def wanted(query: str) -> list[str]:
    """Which figures the query is about; all of them for a general "system status"."""
    found = [name for name, words in (("battery", _BATTERY), ("cpu", _CPU), ("memory", _MEMORY), ("disk", _DISK))
             if _asks(query, words)]
    return found or ["battery", "cpu", "memory", "disk"]


def read_figures(which: list[str], disk_path: Path | None = None) -> SystemFigures:
    import psutil
    values: dict = {}
    if "cpu" in which:
        values.update(cpu_percent=psutil.cpu_percent(interval=CPU_SAMPLE_S), num_cpus=psutil.cpu_count())
        if hasattr(psutil, "getloadavg"):
            values["load_1min"] = psutil.getloadavg()[0]
    if "memory" in which:
        mem = psutil.virtual_memory()
        values.update(memory_percent=mem.percent, memory_used_bytes=mem.total - mem.available,
                      memory_total_bytes=mem.total, memory_available_bytes=mem.available)
    if "disk" in which:
        path = str(disk_path or Path.home())
        disk = psutil.disk_usage(path)
        values.update(disk_path=path, disk_percent=disk.percent, disk_free_bytes=disk.free,
                      disk_total_bytes=disk.total)
    if "battery" in which:
        values.update(_battery(psutil))
    return SystemFigures(**values)


def _battery(psutil) -> dict:
    try:
        battery = psutil.sensors_battery() if hasattr(psutil, "sensors_battery") else None
    except (OSError, RuntimeError):
        battery = None
    if battery is None:
        return {"has_battery": False}
    secs = battery.secsleft if isinstance(battery.secsleft, int) and battery.secsleft > 0 else None
    return {"has_battery": True, "battery_percent": float(battery.percent),
            "battery_plugged": battery.power_plugged, "battery_secs_left": secs}


def answer(query: str, ctx: QueryContext) -> str | None:
    which = wanted(query)
    figures = read_figures(which)
    lines = [_LINES[name](figures, ctx) for name in which]
    return (" " if ctx.lang == "en" else "").join(lines)


def _battery_line(f: SystemFigures, ctx: QueryContext) -> str:
    if not f.has_battery:
        return ctx.say("Battery: none found on this machine.", "电池:这台机器上没有检测到电池。")
    state_en = "plugged in" if f.battery_plugged else "on battery"
    state_zh = "已接电源" if f.battery_plugged else "使用电池中"
    if f.battery_secs_left and not f.battery_plugged:
        hours, minutes = divmod(f.battery_secs_left // 60, 60)
        state_en += f", about {hours} h {minutes} min left"
        state_zh += f",约剩 {hours} 小时 {minutes} 分钟"
    return ctx.say(f"Battery: {f.battery_percent:.0f}% ({state_en}).", f"电池:{f.battery_percent:.0f}%({state_zh})。")


def _cpu_line(f: SystemFigures, ctx: QueryContext) -> str:
    load = f", load {f.load_1min:.2f}" if f.load_1min is not None else ""
    return ctx.say(f"CPU: {f.cpu_percent:.0f}% busy across {f.num_cpus} cores{load}.",
                   f"CPU:{f.cpu_percent:.0f}% 占用,共 {f.num_cpus} 核{load.replace(', load', ',负载')}。")


def _memory_line(f: SystemFigures, ctx: QueryContext) -> str:
    used, total, avail = (f.memory_used_bytes / GIB, f.memory_total_bytes / GIB, f.memory_available_bytes / GIB)
    return ctx.say(f"Memory: {f.memory_percent:.0f}% used ({used:.1f} of {total:.1f} GiB, {avail:.1f} GiB available).",
                   f"内存:已用 {f.memory_percent:.0f}%({used:.1f} / {total:.1f} GiB,可用 {avail:.1f} GiB)。")


def _disk_line(f: SystemFigures, ctx: QueryContext) -> str:
    free, total = f.disk_free_bytes / GIB, f.disk_total_bytes / GIB
    return ctx.say(f"Disk ({f.disk_path}): {f.disk_percent:.0f}% used, {free:.1f} GiB free of {total:.1f} GiB.",
                   f"磁盘({f.disk_path}):已用 {f.disk_percent:.0f}%,剩余 {free:.1f} GiB,共 {total:.1f} GiB。")


_LINES = {"battery": _battery_line, "cpu": _cpu_line, "memory": _memory_line, "disk": _disk_line}
