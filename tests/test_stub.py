"""The .pyi is the contract of the native module: it must name exactly what the module exports."""

import re
from pathlib import Path

import kvbridge._native as native


def test_stub_declares_every_native_name_and_nothing_else():
    stub = (Path(native.__file__).parent / "_native.pyi").read_text()
    declared = set(re.findall(r"^(?:def|class) (\w+)", stub, re.M))
    constants = set(re.findall(r"^(\w+)\s*:\s*(?!TypeAlias)", stub, re.M))
    exported = {name for name in dir(native) if not name.startswith("__")}
    assert exported - declared - constants == set(), "native names missing from _native.pyi"
    assert declared - exported == set(), "_native.pyi declares functions/classes the module lacks"
