"""Stable alias: ``kvbridge.publisher`` is the very module ``kvbridge.bus.publisher``."""

import importlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what a type checker sees under the old path: the module's public names
    from kvbridge.bus.publisher import *  # noqa: F403

sys.modules[__name__] = importlib.import_module("kvbridge.bus.publisher")
