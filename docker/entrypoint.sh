#!/usr/bin/env bash
# Entry point of the horovod_aq images (docker/Dockerfile, docker/Dockerfile.gpu).
#
# If a directory of ssh keys is mounted at /ssh-keys (HOROVOD_AQ_SSH_KEYS), install it as root's
# ~/.ssh and start sshd on port SSHD_PORT (default 12345), so that horovodrun or mpirun in another
# container can start ranks in this one (docker/README.md, "Several nodes"). Then run the command.
# The directory holds a private key (e.g. id_ed25519), its .pub, and optionally authorized_keys
# (default: every *.pub in it).
set -euo pipefail
shopt -s nullglob

keys="${HOROVOD_AQ_SSH_KEYS:-/ssh-keys}"
port="${SSHD_PORT:-12345}"
if [ -d "$keys" ]; then
  install -d -m 700 /root/.ssh
  for f in "$keys"/*; do
    if [ -f "$f" ]; then install -m 600 "$f" /root/.ssh/; fi
  done
  if [ ! -s /root/.ssh/authorized_keys ]; then
    pubs=(/root/.ssh/*.pub)
    [ "${#pubs[@]}" -gt 0 ] || { echo "[horovod_aq] no *.pub key in $keys" >&2; exit 1; }
    cat "${pubs[@]}" > /root/.ssh/authorized_keys
    chmod 600 /root/.ssh/authorized_keys
  fi
  ssh-keygen -A >/dev/null  # this container's own host keys: none are baked into the image
  mkdir -p /run/sshd
  /usr/sbin/sshd -p "$port"
  echo "[horovod_aq] sshd listening on port $port" >&2
fi
exec "$@"
