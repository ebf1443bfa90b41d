#!/usr/bin/env bash
# The sidecar route for SGLang: it publishes the same ZMQ KV events and keeps its last batches for
# the same replay protocol (sglang/srt/disaggregation/kv_events.py, ZmqEventPublisher), so a gap
# is replayed; without --replay-endpoint a gap becomes a hole that consumers repair from the
# relay's snapshot.
set -euo pipefail

python -m sglang.launch_server --model-path Qwen/Qwen3-0.6B --port 30000 \
  --kv-events-config '{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5567", "topic": "kv"}' &

kvbridge relay --endpoint tcp://127.0.0.1:5557 --replay-endpoint tcp://127.0.0.1:5567 --topic kv \
  --model qwen3-0.6b --worker "$(hostname)-dp0" --servers nats://127.0.0.1:4222
# Attention data parallelism: one relay per rank, --dp-rank R (ports + R, as SGLang binds them).
