"""KV transports: prefill (sending role) hands a request's KV blocks to decode (receiving role).

Only a small :class:`~shared.protocol.KVDescriptor` travels through the broker. Handing blocks to a
transport transfers the duty to free them: after ``send`` the prefill engine may reuse its blocks;
after ``receive`` the entry is gone from the store (or, for pooled transports, released).
"""

from shared.kv_transport.base import KVReceiver, KVSender, KVTransport, make_transport
from shared.kv_transport.shm import ShmKVStore

__all__ = ["KVReceiver", "KVSender", "KVTransport", "ShmKVStore", "make_transport"]
