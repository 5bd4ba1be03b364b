"""``python -m simulator --port N [options]``: serve one simulated vLLM server until SIGINT or
SIGTERM (the same options as ``manage.py simulate_vllm``)."""

from __future__ import annotations

import argparse

from simulator.config import add_cli_arguments, config_from_options
from simulator.server import run_simulator


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run a simulated vLLM server.")
    add_cli_arguments(parser)
    options = vars(parser.parse_args(argv))
    run_simulator(config_from_options(options), options["host"], options["port"])


if __name__ == "__main__":
    main()
