"""Control socket: versioned newline-delimited JSON protocol, a server thread
on rank 0 of the replica group, commands applied at step boundaries on every
rank, and the ``omni-ctl`` client. See ``docs/control-protocol.md``.

The Trainer imports :class:`megascale_omni.control.plane.ControlPlane`; this
package root stays free of torch so ``omni-ctl`` starts fast.
"""

from megascale_omni.control.client import ControlClient, ControlError
from megascale_omni.control.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, ErrorCode

__all__ = ["ControlClient", "ControlError", "ErrorCode", "MAX_MESSAGE_BYTES", "PROTOCOL_VERSION"]
