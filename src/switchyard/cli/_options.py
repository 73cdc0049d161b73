"""Options several commands share."""

from __future__ import annotations

import argparse


def add_store_options(p: argparse.ArgumentParser) -> None:
    """Where a command finds the store the gateway with this config uses."""
    p.add_argument("--config", help="config whose storage.sqlite_path to use")
    p.add_argument("--db", help="SQLite file (overrides the config)")
