#!/usr/bin/env bash
# A KV-aware OpenAI gateway in front of vLLM API servers. Each vLLM server runs the kvbridge plugin
# (see vllm_plugin.sh); its load reports carry the URL it advertises and each DP rank, so the gateway
# learns the fleet from NATS. Clients talk to the gateway exactly as they would to vLLM.
set -euo pipefail

export KVBRIDGE_SERVERS=nats://10.0.0.1:4222

# On each GPU host (here 10.0.0.5), two DP ranks behind one API server:
KVBRIDGE_ADVERTISE_URL=http://10.0.0.5:8000 \
vllm serve meta-llama/Llama-3.1-8B-Instruct --port 8000 --data-parallel-size 2 --kv-events-config \
  '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5567"}' &

# Anywhere (one gateway per model; run several behind a load balancer if you like):
kvbridge proxy --model meta-llama/Llama-3.1-8B-Instruct --listen 0.0.0.0:8080
#   --worker gpu-9-dp0=http://10.0.0.9:8000@0   a server without the plugin (ID=URL[@DP rank])
#   --index-service                              scores from `kvbridge index` replicas instead of in-process
#   --tokenizer tokenizer.json                   tokenize completions locally (pip install tokenizers)

# Then, e.g.:
#   curl http://GATEWAY:8080/v1/chat/completions -H 'Content-Type: application/json' \
#     -d '{"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'
#   curl http://GATEWAY:8080/health      # workers, NATS state, routing mode
#   curl http://GATEWAY:8080/metrics     # kvbridge_proxy_* beside the subscriber's metrics
