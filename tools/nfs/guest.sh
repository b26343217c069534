#!/bin/sh
# Stage 2 in the guest (PID 1 after switch_root): start the kernel NFS server on
# the guest's loopback, mount its export several times with nosharecache (one
# client cache per mount, like separate nodes), run the scenarios, report the exit
# status through /nfsh (a 9p share of the host's run directory), power off.
. /nfsh/env.sh
finish() {
    echo "${1:-1}" > /nfsh/rc
    sync
    echo "nfsh: guest done, exit status ${1:-1}"
    echo 1 > /proc/sys/kernel/sysrq
    echo o > /proc/sysrq-trigger
    while :; do :; done
}
trap 'finish 1' EXIT
set -eu
step() { echo "nfsh: $*"; }
step "stage2 on Linux $(uname -r)"
mount -t tmpfs -o mode=0755 run /run
mkdir -p /run/rpcbind /var/lib/nfs/rpc_pipefs /var/lib/nfs/v4recovery /srv/export
ip link set lo up
echo /bin/true > /proc/sys/kernel/modprobe  # modules are all loaded; no /lib/modules here

# The export: a tmpfs (fsid= because tmpfs has no UUID).
mount -t tmpfs -o size=1536m,mode=0755 export /srv/export
mount -t nfsd nfsd /proc/fs/nfsd
mount -t rpc_pipefs rpc_pipefs /var/lib/nfs/rpc_pipefs
# Short lease and grace so that the first NFSv4 opens are not held up for 90 s.
echo 10 > /proc/fs/nfsd/nfsv4leasetime
echo 10 > /proc/fs/nfsd/nfsv4gracetime
# rpcbind drops to _rpc, a user the package's postinst would have created.
grep -q '^_rpc:' /etc/passwd || echo '_rpc:x:911:65534::/run/rpcbind:/usr/sbin/nologin' >> /etc/passwd
rpcbind -w
# 10.99.0.2: the other NFS client of the claims scenario (a network namespace over a veth pair).
export_opts='rw,sync,no_subtree_check,no_root_squash,insecure,fsid=1'
echo "/srv/export 127.0.0.1($export_opts) 10.99.0.0/24($export_opts)" > /etc/exports
exportfs -ra
rpc.mountd
rpc.nfsd 4
step "nfsd up: $(cat /proc/fs/nfsd/versions); exports: $(exportfs -v | tr -s ' \n\t' ' ')"

# One read-write mount for the publisher, read-only ones for the nodes, each its own client cache.
mnt() {  # mnt DIR OPTIONS
    mkdir -p "$1"
    mount -t nfs -o "nosharecache,$2" 127.0.0.1:/srv/export "$1"
    step "mounted $1: $(grep " $1 " /proc/mounts | cut -d' ' -f3,4)"
}
mnt /mnt/publisher rw,vers=4.2
nodes=""
i=0
# The nodes' mount options, one word each. The packed scenario mounts the export again with
# them for each cold job it counts (--nfs-export): a mount's counters then hold that job alone.
for opts in ro,vers=4.2 ro,vers=3,nolock ro,vers=4.2,lookupcache=positive; do
    i=$((i + 1))
    mnt "/mnt/node$i" "$opts"
    nodes="$nodes --node /mnt/node$i --node-options $opts"
done

cd "$NFSH_REPO"
set +e
# tools/ on PYTHONPATH: the scenarios and their workers import testkit (tools/testkit/).
# shellcheck disable=SC2086
PYTHONPATH=tools "$NFSH_PYTHON" tools/nfs/scenarios.py --publisher /mnt/publisher $nodes \
    --nfs-export 127.0.0.1:/srv/export --local /tmp/nodes --json /nfsh/result.json $NFSH_SCENARIO_ARGS
rc=$?
set -e
trap - EXIT
finish "$rc"
