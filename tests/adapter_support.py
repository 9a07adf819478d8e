"""What the adapters' tests share (tests/test_kube_mapping.py, tests/test_slurm_mapping.py and the tests that
import from them): a sink that keeps what a watcher sends, in order, where its JsonlSink or KafkaSink would send it."""

from __future__ import annotations


class ListSink:
    """The events sent (their bodies), in the order sent; flush and close do nothing."""

    def __init__(self):
        self.events = []

    def send(self, body):
        self.events.append(body)

    def flush(self):
        pass

    def close(self):
        pass
