#!/usr/bin/env bash
# The plugin route: no code. `pip install kvbridge` into vLLM's environment registers kvbridge's stat
# logger (entry-point group vllm.stat_logger_plugins, name "kvbridge"); vLLM's API server loads it.
# vLLM's own --kv-events-config turns the engines' ZMQ KV events on; kvbridge relays each
# data-parallel rank's stream to NATS and publishes load reports. kvbridge's settings come from
# KVBRIDGE_* variables (vLLM rejects extra keys in --kv-events-config).
set -euo pipefail

pip install kvbridge

export KVBRIDGE_SERVERS=nats://127.0.0.1:4222      # where the events go
# export KVBRIDGE_WORKER_ID='gpu-node-3-{dp_rank}'  # default: <hostname>-dp<rank>
# export KVBRIDGE_LOAD_INTERVAL_S=1                 # load reports at most this often (0: none)
# export VLLM_PLUGINS=kvbridge                      # only if you restrict vLLM's plugins

vllm serve meta-llama/Llama-3.1-8B-Instruct --data-parallel-size 2 --kv-events-config \
  '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5567", "topic": "kv"}'

# Rank r publishes on port 5557 + r (replay 5567 + r); the log says what kvbridge relays:
#   kvbridge: attached to model meta-llama/Llama-3_1-8B-Instruct (dp0=host-dp0, dp1=host-dp1), API server 0: relaying ...
# Watch it:  kvbridge watch --servers nats://127.0.0.1:4222
