"""Communication: the TP communicator (and, later, the custom all-reduce behind it)."""

from tpgraph.comm.communicator import TPCommunicator

__all__ = ["TPCommunicator"]
