"""The pod's start command: authorise the run's key, start sshd, and stop the pod when the orchestrator is gone.

It is the container's main process (``dockerArgs``, which replaces the image's own start command, so it starts sshd
itself as the Runpod images' ``/start.sh`` would). Every SSH command of the backend touches ``<remote_root>/heartbeat``;
when the file is older than the dead-man timeout, the pod deletes itself through the REST API with its own pod-scoped
key (``RUNPOD_API_KEY`` inside a pod), falling back to a stop. The script travels base64-encoded, since the SDK pastes
the start command into its GraphQL text unescaped.
"""

from __future__ import annotations

import base64
import shlex

SCRIPT = r"""
cd ~ || exit 1
umask 022
mkdir -p ~/.ssh && chmod 700 ~/.ssh
if [ -n "$PUBLIC_KEY" ] && ! grep -qxF "$PUBLIC_KEY" ~/.ssh/authorized_keys 2>/dev/null; then
  echo "$PUBLIC_KEY" >> ~/.ssh/authorized_keys
fi
chmod 600 ~/.ssh/authorized_keys 2>/dev/null
if ! pgrep -x sshd >/dev/null 2>&1; then
  mkdir -p /run/sshd; ssh-keygen -A >/dev/null 2>&1
  /usr/sbin/sshd || service ssh start
fi
ROOT=__ROOT__
mkdir -p "$ROOT" && touch "$ROOT/heartbeat"
while sleep __CHECK__; do
  now=$(date +%s); seen=$(stat -c %Y "$ROOT/heartbeat" 2>/dev/null || echo 0)
  if [ $((now - seen)) -gt __DEADMAN__ ]; then
    echo "no heartbeat for $((now - seen)) s: the orchestrator is gone; deleting this pod"
    for method in DELETE POST; do
      url="__REST__/pods/$RUNPOD_POD_ID"; [ "$method" = POST ] && url="$url/stop"
      python3 -c 'import os, sys, urllib.request as u
u.urlopen(u.Request(sys.argv[2], method=sys.argv[1],
                    headers={"Authorization": "Bearer " + os.environ["RUNPOD_API_KEY"]}),
          timeout=30)' "$method" "$url" && exit 0
      curl -fsS -X "$method" -H "Authorization: Bearer $RUNPOD_API_KEY" "$url" && exit 0
    done
    sleep 60
  fi
done
"""


def start_command(*, remote_root: str, rest_url: str, deadman_s: float) -> str:
    """The pod's ``dockerArgs``: the keeper script, base64 inside a quote-free shell line."""
    check = max(1, min(30, int(deadman_s // 4) or 1))
    script = (SCRIPT.replace("__ROOT__", shlex.quote(remote_root)).replace("__CHECK__", str(check))
              .replace("__DEADMAN__", str(int(deadman_s))).replace("__REST__", rest_url.rstrip("/")))
    encoded = base64.b64encode(script.encode()).decode()
    return f"bash -c 'echo {encoded} | base64 -d | bash'"
