"""kvbridge's vLLM attach under the path users type: ``from kvbridge.vllm import logger_factory``.

The plugin itself lives in :mod:`kvbridge.engine.vllm` (vLLM's entry point names that home); this face
re-exports its public names, so importing it has the same effects as importing the plugin.
"""

from kvbridge.engine.vllm import KvBridgeStatLogger, Plan, advertise_url, logger_factory, plan, shutdown

__all__ = ["KvBridgeStatLogger", "Plan", "advertise_url", "logger_factory", "plan", "shutdown"]
