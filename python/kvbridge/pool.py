"""Stable alias: ``kvbridge.pool`` is the very module ``kvbridge.engine.pool``."""

import importlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what a type checker sees under the old path: the module's public names
    from kvbridge.engine.pool import *  # noqa: F403

sys.modules[__name__] = importlib.import_module("kvbridge.engine.pool")
