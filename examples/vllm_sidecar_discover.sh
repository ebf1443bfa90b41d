#!/usr/bin/env bash
# The sidecar route for vLLM without the plugin (or for ranks the plugin cannot reach: engines on
# other nodes with tcp://*:0 ports). `kvbridge relay --discover` reads the API server's
# /kv_event_sources (vLLM >= 0.33), runs one relay per data-parallel rank it lists, and follows
# ranks that appear or go away. It can run on any host that reaches the engines.
set -euo pipefail

vllm serve meta-llama/Llama-3.1-8B-Instruct --data-parallel-size 2 --port 8000 --kv-events-config \
  '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5567", "topic": "kv"}' &

# '*' in the listed endpoints means the API server's host; the model name comes from /v1/models
# unless --model is given; workers are <HOST>-dp<rank> (this machine's name for 127.0.0.1, as the
# plugin names them) unless --worker 'name-{dp_rank}'.
kvbridge relay --discover http://127.0.0.1:8000 --servers nats://127.0.0.1:4222
