"""The logger_factory route: vLLM in Python, kvbridge's stat logger given in code.

Keyword options are kvbridge.Config fields and win over KVBRIDGE_* variables. If kvbridge is also
installed as a plugin, both share the same relays: one per data-parallel rank, never two.
"""

import asyncio

from vllm import SamplingParams
from vllm.config import KVEventsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM

from kvbridge.vllm import logger_factory

KV_EVENTS = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint="tcp://*:5557",
                           replay_endpoint="tcp://*:5567", topic="kv")


async def main() -> None:
    args = AsyncEngineArgs(model="Qwen/Qwen3-0.6B", kv_events_config=KV_EVENTS, disable_log_stats=False)
    engine = AsyncLLM.from_engine_args(
        args, stat_loggers=[logger_factory(servers=["nats://127.0.0.1:4222"], model="qwen3-0.6b", load_interval_s=0.5)]
    )
    try:
        async for out in engine.generate("The capital of France is", SamplingParams(max_tokens=16), request_id="r1"):
            pass
        print(out.outputs[0].text)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())

# The offline engine takes the same factory when stats logging is on (the LLM class turns it off):
#   LLMEngine.from_engine_args(EngineArgs(..., kv_events_config=KV_EVENTS, disable_log_stats=False),
#                              stat_loggers=[logger_factory(servers=[...])])
