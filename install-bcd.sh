#!/bin/sh
# install-bcd.sh: the template `better-compute daemon install-script` will render
# (issue 6: download and verify bcd, write config.toml and join-encryption.jwk, create
# the bcd user, run `bcd join` with the token on standard input, enable bcd.service).
# Until that lands this template installs nothing; see docs/node-hosts.md for the
# manual steps that work today.
echo "install-bcd.sh: not rendered yet; see docs/node-hosts.md (issue 6)" >&2
exit 1
