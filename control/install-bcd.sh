#!/bin/sh
# install-bcd.sh: install bcd on this machine, join it, and run it under systemd.
#
#   BCD_JOIN_TOKEN=bcjt_... sudo -E sh install-bcd.sh   # the token in the environment
#   sudo sh install-bcd.sh < token-file                 # or on standard input
#   sudo sh install-bcd.sh < /dev/null                  # no token: upgrade a joined host
#   BCD_JOIN_ATTESTOR=NAME sudo -E sh install-bcd.sh < /dev/null   # join with an attestor
#                                                       # plugin bundled in bcd, no token
#
# The token is read only from BCD_JOIN_TOKEN or standard input, never from an
# argument or a URL, leaves the environment before any process is started, is passed
# to `bcd join` on its standard input alone and is never written to disk. Step by
# step (docs/installing.md):
#   1. checks: root, no arguments, the token's form, this machine's architecture,
#      sha256sum, curl or wget, a python3 of 3.11 or newer, useradd;
#   2. downloads bcd for this architecture and checks its SHA-256 (nothing is
#      installed before this passes);
#   3. unpacks it into /usr/local/lib/bcd/<version>-<sha256 prefix>/ (new directory,
#      renamed into place when complete);
#   4. creates the bcd system user and /etc/bcd (0755), /var/lib/bcd (0700, bcd),
#      /var/lib/bcd-hostconfig (0700, root);
#   5. with a token: writes /etc/bcd/config.toml and /etc/bcd/join-encryption.jwk
#      (0644, temporary file and rename); /etc/bcd/serving-ca.pem (the serving CA
#      certificate, the node's TLS trust anchor) with a token, and on an upgrade
#      when it is missing;
#   6. installs the systemd units and tmpfiles.d entry under /usr/local/lib and points
#      /usr/local/bin/bcd at the new version (a symlink, switched by rename);
#   7. with a token: runs `bcd join` with the token on standard input (with
#      BCD_JOIN_ATTESTOR and no token: `bcd join --attestor NAME`);
#   8. enables bcd-join.service, bcd-helper.service and bcd.service and starts (a first
#      install) or restarts (an upgrade) bcd-helper.service and bcd.service.
# A failure before the join is done removes what this run created and restores what
# it replaced; after a successful join nothing is undone.
#
# This file is the template: `better-compute daemon install-script` replaces the
# marker line below with the values for one pool and site.
set -eu
umask 022

# The token, first of all: BCD_JOIN_TOKEN, else one line of standard input (unless it
# is a terminal). It stays in an unexported shell variable and BCD_JOIN_TOKEN leaves
# the environment here, before this script starts any process (every command up to
# the unset is a shell builtin), so no program started here sees it. It is checked in
# step 1 below.
token=""
if [ -n "${BCD_JOIN_TOKEN:-}" ]; then
    token=$BCD_JOIN_TOKEN
elif [ ! -t 0 ]; then
    read -r token || true
fi
unset BCD_JOIN_TOKEN || true
# Or no token and an attestor plugin in the artifact joins (not a secret).
attestor=${BCD_JOIN_ATTESTOR:-}

# @@RENDERED@@

PATH=${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}
LIBDIR=/usr/local/lib/bcd
BIN=/usr/local/bin/bcd
UNITDIR=/usr/local/lib/systemd/system
TMPFILESDIR=/usr/local/lib/tmpfiles.d
CONF_DIR=/etc/bcd
CONFIG=$CONF_DIR/config.toml
JWK=$CONF_DIR/join-encryption.jwk
SERVING_CA=$CONF_DIR/serving-ca.pem
DATA_DIR=/var/lib/bcd
HOSTCONFIG_DIR=/var/lib/bcd-hostconfig
BCD_USER=bcd
UNITS="bcd-join.service bcd-helper.service bcd.service"
RUNNING_UNITS="bcd-helper.service bcd.service"
BAK=.bcd-install-bak

say() { printf 'install-bcd.sh: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }

# --- undo: what this run created or replaced, undone in reverse on failure ---------
CREATED=""      # paths to remove, newest first
REPLACED=""     # paths whose previous version waits at <path>.bcd-install-bak
CREATED_USER=no
OLD_LINK=""     # what /usr/local/bin/bcd pointed to before (empty: nothing)
LINK_SWITCHED=no
COMMITTED=no
WORK=""

created() { CREATED="$1
$CREATED"; }

rollback() {
    if [ "$LINK_SWITCHED" = yes ]; then
        if [ -n "$OLD_LINK" ]; then
            ln -sfn "$OLD_LINK" "$BIN.$$.tmp" && mv -f "$BIN.$$.tmp" "$BIN" || true
        else
            rm -f "$BIN"
        fi
    fi
    for path in $REPLACED; do
        [ -e "$path$BAK" ] && mv -f "$path$BAK" "$path" || true
    done
    for path in $CREATED; do
        rm -rf "$path" || true
    done
    if [ "$CREATED_USER" = yes ]; then
        userdel "$BCD_USER" >/dev/null 2>&1 || say "could not remove the user $BCD_USER"
    fi
}

on_exit() {
    rc=$?
    trap - EXIT INT TERM HUP
    token=""
    [ -n "$WORK" ] && rm -rf "$WORK"
    if [ "$rc" -ne 0 ] && [ "$COMMITTED" = no ]; then
        rollback
        say "stopped; nothing of this run was left installed"
    else
        for path in $REPLACED; do rm -f "$path$BAK"; done
    fi
    exit "$rc"
}
trap on_exit EXIT
trap 'exit 130' INT TERM HUP

# Atomically put the content of stdin at $1 with mode $2 (temporary file and rename);
# an existing file is kept as $1.bcd-install-bak until the run ends.
put() {
    tmp="$1.$$.tmp"
    rm -f "$tmp"
    created "$tmp"
    cat >"$tmp"
    chmod "$2" "$tmp"
    chown root:root "$tmp"
    if [ -e "$1" ]; then
        cp -p "$1" "$1$BAK"
        REPLACED="$1 $REPLACED"
    else
        created "$1"
    fi
    mv -f "$tmp" "$1"
}

# bcd's own directory $1 with owner $2 and mode $3 (an existing one gets them too);
# recorded for undo when new.
dir() {
    if [ ! -d "$1" ]; then
        mkdir "$1"
        created "$1"
    fi
    chown "$2" "$1"
    chmod "$3" "$1"
}

# A system directory (/usr/local/lib/systemd, ...): made 0755 root when missing,
# otherwise left as it is.
sysdir() {
    if [ ! -d "$1" ]; then
        mkdir -m 0755 "$1"
        created "$1"
    fi
}

# --- 1. checks, before anything is written ------------------------------------------
if [ -z "${BCD_VERSION:-}" ]; then
    die "this is the unrendered template; generate the script with: better-compute daemon install-script --pool ... (docs/installing.md)"
fi

for arg in "$@"; do
    case $arg in
        *bcjt_*|*.*[A-Za-z0-9_-][A-Za-z0-9_-][A-Za-z0-9_-][A-Za-z0-9_-][A-Za-z0-9_-][A-Za-z0-9_-][A-Za-z0-9_-][A-Za-z0-9_-][A-Za-z0-9_-][A-Za-z0-9_-]*)
            die "an argument looks like a join token; the token is never read from the command line (it was not echoed, and now sits in your shell history: revoke it). Pass it in BCD_JOIN_TOKEN or on standard input" ;;
    esac
done
if [ "$#" -gt 0 ]; then
    die "install-bcd.sh takes no arguments (none were echoed); pass the join token in BCD_JOIN_TOKEN or on standard input"
fi

if [ "$(id -u)" != 0 ]; then
    die "run it as root (sudo sh install-bcd.sh); it installs bcd and writes /etc/bcd"
fi

# The token read at the top: its form.
if [ -n "$token" ]; then
    case $token in
        bcjt_*) ;;
        *) die "the join token does not look like a join token (bcjt_...); it was not echoed. Use the token from better-compute join-tokens create" ;;
    esac
    case $token in
        *[!A-Za-z0-9._-]*) die "the join token holds characters a join token (bcjt_...) never has; it was not echoed" ;;
    esac
    if [ "${#token}" -gt 512 ]; then
        die "the join token is too long for a join token (bcjt_...); it was not echoed"
    fi
    [ -z "$attestor" ] || die "both a join token and BCD_JOIN_ATTESTOR; pass only one (the token joins with join-token)"
    MODE=install
elif [ -n "$attestor" ]; then
    case $attestor in
        *[!a-z0-9-]*|-*) die "BCD_JOIN_ATTESTOR is not an attestor name (a-z, 0-9 and -)" ;;
    esac
    [ "${#attestor}" -le 64 ] || die "BCD_JOIN_ATTESTOR is not an attestor name (at most 64 characters)"
    MODE=install
elif [ -f "$CONFIG" ]; then
    MODE=upgrade
else
    die "no join token, and $CONFIG does not exist (so this is not an upgrade): pass the token in BCD_JOIN_TOKEN or on standard input"
fi

case $(uname -m) in
    x86_64|amd64) ARCH=amd64; SHA256=$SHA256_AMD64 ;;
    aarch64|arm64) ARCH=arm64; SHA256=$SHA256_ARM64 ;;
    *) die "this machine is $(uname -m); bcd is built for amd64 and arm64 only" ;;
esac
if [ -z "$SHA256" ]; then
    die "this script has no bcd for $ARCH; generate it again with --sha256 $ARCH=<hex>"
fi

command -v sha256sum >/dev/null 2>&1 ||
    die "sha256sum is missing (GNU coreutils), so the download cannot be checked; nothing was installed"
if command -v curl >/dev/null 2>&1; then
    FETCH=curl
elif command -v wget >/dev/null 2>&1; then
    FETCH=wget
else
    die "neither curl nor wget is installed; install one (apt-get install curl) and run this again"
fi
PYTHON=""
for candidate in python3 python3.13 python3.12 python3.11; do
    found=$(command -v "$candidate" 2>/dev/null) || continue
    if "$found" -c 'import sys; sys.exit(not sys.version_info >= (3, 11))' >/dev/null 2>&1; then
        PYTHON=$found
        break
    fi
done
[ -n "$PYTHON" ] || die "bcd needs Python 3.11 or newer as python3 (apt-get install python3); none was found"
if ! id -u "$BCD_USER" >/dev/null 2>&1; then
    command -v useradd >/dev/null 2>&1 || die "useradd is missing; it creates the $BCD_USER user"
fi

if [ "$MODE" = install ]; then
    say "installing bcd $BCD_VERSION ($ARCH) for pool $POOL (site $SITE), gateway $GATEWAY_URL"
else
    say "upgrading bcd to $BCD_VERSION ($ARCH); $CONFIG is kept"
fi

# --- 2. download and check -----------------------------------------------------------
URL="$BASE_URL$BASE_PATH/downloads/bcd/$BCD_VERSION/linux-$ARCH"
# In /tmp itself, never the caller's TMPDIR (sudo -E keeps it): a directory another
# user owns would let them swap the download between its check and its use.
WORK=$(mktemp -d /tmp/install-bcd.XXXXXX)
if [ "$FETCH" = curl ]; then
    if ! why=$(curl --fail --silent --show-error --location --proto '=https,http' \
        --proto-redir '=https' --connect-timeout 20 --max-time 600 --retry 2 \
        --output "$WORK/bcd" "$URL" 2>&1); then
        die "cannot download bcd from $URL: $(printf '%s' "$why" | tr '\n' ' '); nothing was installed"
    fi
else
    wget --quiet --timeout=20 --tries=3 --output-document="$WORK/bcd" "$URL" ||
        die "cannot download bcd from $URL (wget exit $?); nothing was installed"
fi
actual=$(sha256sum "$WORK/bcd" | cut -d ' ' -f 1)
if [ "$actual" != "$SHA256" ]; then
    die "the SHA-256 of $URL is $actual, but this script expects $SHA256; nothing was installed"
fi

# --- 3. unpack -------------------------------------------------------------------------
sysdir /usr/local/lib
dir "$LIBDIR" root:root 0755
VERSION_DIR="$LIBDIR/$BCD_VERSION-$(printf '%.12s' "$SHA256")"
if [ -x "$VERSION_DIR/bin/bcd" ] && [ -f "$VERSION_DIR/bcd-artifact.json" ]; then
    say "bcd $BCD_VERSION is already unpacked in $VERSION_DIR"
else
    rm -rf "$VERSION_DIR"
    created "$VERSION_DIR"
    "$PYTHON" -I -S "$WORK/bcd" unpack "$VERSION_DIR" >/dev/null ||
        die "cannot unpack bcd with $PYTHON (above)"
fi

# --- 4. the user and the directories -------------------------------------------------
if ! id -u "$BCD_USER" >/dev/null 2>&1; then
    useradd --system --user-group --home-dir "$DATA_DIR" --no-create-home \
        --shell /usr/sbin/nologin --comment "better-compute node agent" "$BCD_USER" ||
        die "cannot create the user $BCD_USER"
    CREATED_USER=yes
fi
dir "$CONF_DIR" root:root 0755
dir "$DATA_DIR" "$BCD_USER:$BCD_USER" 0700
dir "$HOSTCONFIG_DIR" root:root 0700

# --- 5. config.toml, join-encryption.jwk and serving-ca.pem --------------------------------
if [ "$MODE" = install ]; then
    # Here-documents, not pipelines: put must run in this shell to record its undo.
    put "$CONFIG" 0644 <<EOF
$CONFIG_TOML
EOF
    put "$JWK" 0644 <<EOF
$JOIN_JWK
EOF
fi
# serving-ca.pem: checked against serving_ca_spki_pin when the script was rendered,
# and by bcd when it loads it.
if [ -n "$SERVING_CA_PEM" ] && { [ "$MODE" = install ] || [ ! -e "$SERVING_CA" ]; }; then
    put "$SERVING_CA" 0644 <<EOF
$SERVING_CA_PEM
EOF
fi

# --- 6. units, tmpfiles.d, and the switch to the new version ------------------------------
sysdir /usr/local/lib/systemd
sysdir "$UNITDIR"
sysdir "$TMPFILESDIR"
for unit in $UNITS; do
    put "$UNITDIR/$unit" 0644 <"$VERSION_DIR/share/systemd/$unit"
done
put "$TMPFILESDIR/bcd.conf" 0644 <"$VERSION_DIR/share/tmpfiles.d/bcd.conf"
sysdir /usr/local/bin
if [ -L "$BIN" ]; then
    OLD_LINK=$(readlink "$BIN")
elif [ -e "$BIN" ]; then
    die "$BIN exists and is not a symlink (bcd installed another way?); move it aside and run this again"
fi
ln -sfn "$VERSION_DIR/bin/bcd" "$BIN.$$.tmp"
mv -f "$BIN.$$.tmp" "$BIN"
LINK_SWITCHED=yes

# --- 7. join ------------------------------------------------------------------------------
if [ "$MODE" = install ] && [ -n "$attestor" ]; then
    "$BIN" join --config "$CONFIG" --server "$BASE_URL" --attestor "$attestor" </dev/null ||
        die "bcd join failed (above)"
elif [ "$MODE" = install ]; then
    # printf is built in: the token reaches bcd join through the pipe alone.
    if ! printf '%s\n' "$token" | "$BIN" join --config "$CONFIG" --server "$BASE_URL"; then
        token=""
        die "bcd join failed (above)"
    fi
    token=""
fi
COMMITTED=yes

# Older unpacked versions: keep the one this run replaced, remove the rest.
for old in "$LIBDIR"/*; do
    [ -d "$old" ] || continue
    case $old in
        "$VERSION_DIR") ;;
        "${OLD_LINK%/bin/bcd}") ;;
        *) rm -rf "$old" ;;
    esac
done

# --- 8. systemd ------------------------------------------------------------------------------
if ! command -v systemctl >/dev/null 2>&1; then
    say "systemctl not found: bcd is installed; run bcd helper and bcd node yourself (docs/installing.md)"
    exit 0
fi
if command -v systemd-tmpfiles >/dev/null 2>&1; then
    systemd-tmpfiles --create "$TMPFILESDIR/bcd.conf" >/dev/null 2>&1 ||
        say "warning: systemd-tmpfiles --create $TMPFILESDIR/bcd.conf failed"
fi
systemctl daemon-reload || die "systemctl daemon-reload failed; bcd is installed, start it with: systemctl enable --now $RUNNING_UNITS"
# shellcheck disable=SC2086 # the unit lists are words
systemctl enable $UNITS || die "systemctl enable failed; bcd is installed: systemctl enable $UNITS"
if [ -z "$OLD_LINK" ]; then
    # shellcheck disable=SC2086
    systemctl start $RUNNING_UNITS || die "bcd did not start: journalctl -u bcd -u bcd-helper"
    say "bcd $BCD_VERSION is installed and running"
else
    # shellcheck disable=SC2086
    systemctl restart $RUNNING_UNITS || die "bcd did not restart: journalctl -u bcd -u bcd-helper"
    say "bcd $BCD_VERSION is installed and restarted"
fi
