# Source on the lent GPU machine after ../shared/gpu/install.sh ran (see bench/README or
# docs): puts vLLM 0.26 and this checkout (as the `capsteer` package) on PYTHONPATH.
# The package dir is per shell ($$), so two benchmarks started side by side (one per GPU,
# bench/gpu_pair.sh) do not rebuild each other's copy.
CS=/tmp/cs-$$
mkdir -p "$CS" && rm -rf "$CS/capsteer" && cp -r capsteer "$CS/"
for d in server capture steering engine_ext config; do ln -sfn "$PWD/$d" "$CS/capsteer/$d"; done
export PYTHONPATH=$CS:/tmp/site:${PYTHONPATH:-}
export VLLM_USE_FLASHINFER_SAMPLER=0
