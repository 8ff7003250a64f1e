# Source on the lent GPU machine after ../shared/gpu/install.sh ran (see bench/README or
# docs): puts vLLM 0.26 and this checkout (as the `capsteer` package) on PYTHONPATH.
mkdir -p /tmp/cs && rm -rf /tmp/cs/capsteer && cp -r capsteer /tmp/cs/
for d in server capture steering engine_ext config; do ln -sfn "$PWD/$d" "/tmp/cs/capsteer/$d"; done
export PYTHONPATH=/tmp/cs:/tmp/site:${PYTHONPATH:-}
export VLLM_USE_FLASHINFER_SAMPLER=0
