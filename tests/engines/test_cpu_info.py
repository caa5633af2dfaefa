"""``remember_cpu_info``: DeepSpeed's three py-cpuinfo questions per CPU Adam cost one subprocess, not three."""

import cpuinfo

from dsrl.engines.deepspeed_setup import remember_cpu_info


def test_cpu_info_is_asked_once_and_every_caller_gets_its_own_copy(monkeypatch):
    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: calls.append(1) or {"arch": "X86_64", "flags": ["avx2"]})
    remember_cpu_info()
    first = cpuinfo.get_cpu_info()
    first["arch"] = "changed by a caller"
    assert cpuinfo.get_cpu_info() == {"arch": "X86_64", "flags": ["avx2"]}
    remember_cpu_info()  # a second engine: still the one answer
    from cpuinfo import get_cpu_info  # as DeepSpeed imports it, at call time

    assert get_cpu_info()["arch"] == "X86_64"
    assert calls == [1]
