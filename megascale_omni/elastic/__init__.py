"""Elastic data parallelism across replica groups (torchft), one concern per module.

- ``service``: what the Trainer sees: ``build_membership`` gives the static
  membership (the null object) or the elastic one; each step's share, its
  retry on a quorum change (``run_step``), the checkpoint writer predicate.
- ``membership``: the quorum of each step (``ReplicaQuorum``,
  ``Participation``, ``MembershipChanged``), commit, join and leave.
- ``cross_replica``: sums over the participants (gradients bucket group by
  bucket group, token count, reports).
- ``heal``: how a joining group fetches a live peer's state.
- ``peer_state``: the in-memory state a peer sends beyond weights, and the
  checks a joiner runs before applying it.
- ``ledger``: which samples each committed step consumed.
- ``adapter``: every access to megatron-core DDP or torchft internals,
  version-checked at import.

Nothing is imported here: importing the package costs nothing and imports
no torchft.
"""
