"""Node-key backends: :mod:`bcd.keys.node` (the :class:`~bcd.keys.node.NodeKey` protocol:
a file key, a TPM key through ``bcd helper``, a TPM key root holds) and
:mod:`bcd.keys.file` (a file key's PKCS#8 PEM encoding)."""
