"""Fault-tolerant data parallelism on torchft: each step a transaction over fsync's state.

``pip install 'fsync[ft]'`` brings torchft; it is imported on first use. See the
guide "Fault tolerance" (docs/fault-tolerance.md).
"""

from fsync.ft._connect import lighthouse
from fsync.ft._manager_group import ManagerGroup
from fsync.ft._mesh import ReplicaMesh
from fsync.ft._quorum import QuorumError
from fsync.ft._transaction import Outcome, Replica

__all__ = ["ManagerGroup", "Outcome", "QuorumError", "Replica", "ReplicaMesh", "lighthouse"]
