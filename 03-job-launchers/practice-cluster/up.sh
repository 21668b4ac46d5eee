#!/usr/bin/env bash
# Bring up a real two-node Slurm cluster on this one Linux machine, to practise multi-node launches.
#
# As root:
#   practice-cluster/up.sh [STATE_DIR]           # default: $PRACTICE_CLUSTER_DIR or /tmp/practice-cluster
#   export SLURM_CONF=STATE_DIR/slurm.conf       # then sbatch, srun, squeue, scontrol talk to it
#   practice-cluster/down.sh [STATE_DIR]
#
# Each "node" is a network namespace (node0 = 10.200.0.1, node1 = 10.200.0.2) on a bridge br-tut
# (10.200.0.254, the controller's address), with its own hostname and /etc/hosts, running its own slurmd.
# Both nodes see this machine's filesystem, like a cluster's shared home directory. Nothing leaves the
# machine: no default route, no forwarding, and the only addresses used are the ones created here.
# Needs root and: apt-get install slurmctld slurmd slurm-client munge iproute2 util-linux
# With openssh-server installed, each node also runs an sshd: ssh -F STATE_DIR/ssh/config node1
set -euo pipefail

dir=$(realpath -m "${1:-${PRACTICE_CLUSTER_DIR:-/tmp/practice-cluster}}")
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bridge=br-tut
nodes=(node0 node1)
controller_addr=10.200.0.254

fail() { echo "error: $*" >&2; exit 1; }
[[ $EUID -eq 0 ]] || fail "run as root: it creates network namespaces and starts daemons (sudo $0)"
for tool in munged slurmctld slurmd sbatch sinfo ip nsenter unshare runuser; do
    command -v "$tool" >/dev/null || fail "$tool not found; apt-get install slurmctld slurmd slurm-client munge iproute2"
done
[[ -e $dir/created ]] && fail "a practice cluster is already up in $dir; run $here/down.sh $dir first"

# A cluster whose processes all died without down.sh (a killed session, a restored machine snapshot) leaves its
# bridge and namespaces in the kernel. Remove such a leftover; refuse if anything still runs in its nodes.
if ip link show "$bridge" &>/dev/null; then
    owner=$(ip -o link show "$bridge" | sed -n 's/.* alias practice-cluster \(.*\)$/\1/p')
    # (not `ip ... | grep -q`: under pipefail, grep's early exit can fail the pipeline with ip's SIGPIPE)
    [[ $(ip -o addr show dev "$bridge") == *" $controller_addr/24 "* ]] ||
        fail "interface $bridge exists already and is not a practice cluster's; remove it first"
    for node in "${nodes[@]}"; do
        [[ -n $(ip netns pids "$node" 2>/dev/null) ]] && fail "a practice cluster still runs on $bridge" \
            "(state in ${owner:-an unknown folder}); run $here/down.sh ${owner:-STATE_DIR} first"
    done
    echo "removing a practice cluster left behind with nothing running (state in ${owner:-an unknown folder})" >&2
    if [[ -n $owner && -e $owner/created ]]; then
        "$here/down.sh" "$owner" >&2
    else
        for node in "${nodes[@]}"; do
            ip link del "veth-$node" 2>/dev/null || true
            [[ -e /run/netns/$node ]] && ip netns del "$node"
        done
        ip link del "$bridge"
    fi
fi
for node in "${nodes[@]}"; do
    [[ -e /run/netns/$node ]] && fail "network namespace $node exists already; remove it first (ip netns del $node)"
done

# NOTE: from here on, any failure tears down whatever was started, so a failed up leaves nothing behind.
trap 'echo "up.sh failed; tearing down" >&2; "$here/down.sh" "$dir" >&2' ERR
mkdir -p "$dir"
rm -rf "$dir"/ctld "$dir"/slurmd-* "$dir"/tmp-* "$dir"/munge "$dir"/ssh
mkdir -p "$dir/ctld"
: >"$dir/created"   # down.sh removes only what is listed here

# --- two hosts: a bridge and one namespace per node, each with a veth whose inner end is eth0 ---
ip link add "$bridge" type bridge
echo "link $bridge" >>"$dir/created"
ip link set "$bridge" alias "practice-cluster $dir"   # so that a later up.sh finds a leftover's state
ip addr add "$controller_addr/24" dev "$bridge"
ip link set "$bridge" up
for i in "${!nodes[@]}"; do
    node=${nodes[$i]}
    ip netns add "$node"
    echo "netns $node" >>"$dir/created"
    ip link add "veth-$node" type veth peer name eth0 netns "$node"
    echo "link veth-$node" >>"$dir/created"
    ip link set "veth-$node" master "$bridge" up
    ip -n "$node" addr add "10.200.0.$((i + 1))/24" dev eth0
    ip -n "$node" link set eth0 up
    ip -n "$node" link set lo up
    mkdir -p "$dir/tmp-$node"
done
# NOTE: each node resolves its own and the other's name to the bridge address, as cluster DNS would. A node
# whose name resolves to 127.0.x.x (Debian's default /etc/hosts) is the classic multi-node hang.
# NOTE: the ::ffff: lines name the same addresses as the IPv6 sockets see them. c10d's store listens on one
# socket for IPv6 and IPv4, so it sees a client at 10.200.0.2 as ::ffff:10.200.0.2 and looks that up to name
# it. glibc's /etc/hosts lookup does not map it back to 10.200.0.2 and asks DNS, which the namespaces cannot
# reach: without these lines every launch warns "[c10d] The hostname of the client socket cannot be
# retrieved. err=-3" (EAI_AGAIN, a failed DNS lookup).
{
    for prefix in "" "::ffff:"; do
        echo "${prefix}127.0.0.1 localhost"
        echo "$prefix$controller_addr $(hostname)"
        for i in "${!nodes[@]}"; do echo "${prefix}10.200.0.$((i + 1)) ${nodes[$i]}"; done
    done
    echo "::1 localhost"
} >"$dir/hosts"

# --- munge: authenticates every Slurm message; its own key, socket and daemon for this cluster ---
mkdir -p "$dir/munge"
dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chown -R munge:munge "$dir/munge"
chmod 711 "$dir/munge"   # NOTE: munged wants its socket folder searchable by all
chmod 400 "$dir/munge/munge.key"
runuser -u munge -- munged --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"
for _ in $(seq 50); do [[ -s $dir/munge/munged.pid ]] && break; sleep 0.1; done
cp "$dir/munge/munged.pid" "$dir/munged.pid"

# --- slurm.conf: one controller on the bridge address, two nodes with this machine's CPUs ---
cpus=$(slurmd -C | head -n1 | grep -o 'CPUs=.*ThreadsPerCore=[0-9]*')
cat >"$dir/slurm.conf" <<CONF
ClusterName=practice
# NOTE: SlurmctldHost must be this machine's real hostname, else slurmctld says it is "not a valid controller".
SlurmctldHost=$(hostname)($controller_addr)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# NOTE: cred_expire is also how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=10
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/slurmd-%n
# NOTE: both nodes share one /tmp; a TmpFS per node keeps their job temp dirs apart.
TmpFS=$dir/tmp-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
KillWait=5
MinJobAge=300
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/jobcomp.txt
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/linux
NodeName=node0 NodeHostname=node0 NodeAddr=10.200.0.1 $cpus RealMemory=4000
NodeName=node1 NodeHostname=node1 NodeAddr=10.200.0.2 $cpus RealMemory=4000
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
echo "export SLURM_CONF=$dir/slurm.conf" >"$dir/env.sh"
export SLURM_CONF=$dir/slurm.conf

slurmctld -f "$dir/slurm.conf"
# NOTE: enter the node's network namespace plus a fresh hostname (UTS) and mount namespace for its own
# /etc/hosts. `ip netns exec` would remount /sys, and slurmd then finds no cgroup filesystem.
for node in "${nodes[@]}"; do
    nsenter --net="/run/netns/$node" unshare --uts --mount --propagation private \
        sh -c 'mount --bind "$1" /etc/hosts && hostname "$2" && exec slurmd -f "$3" -N "$2"' \
        sh "$dir/hosts" "$node" "$dir/slurm.conf"
done

for _ in $(seq 100); do
    [[ $(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle$') -eq ${#nodes[@]} ]] && break
    sleep 0.2
done
[[ $(sinfo -h -N -o '%N %t' | grep -c ' idle$') -eq ${#nodes[@]} ]] || {
    sinfo -N >&2
    false
}

# --- ssh into the nodes (if openssh-server is installed): one sshd per node, on that node's address only ---
if [[ -x /usr/sbin/sshd ]] && command -v ssh-keygen >/dev/null; then
    mkdir -p "$dir/ssh" /run/sshd   # NOTE: sshd refuses to start without its privilege-separation folder
    ssh-keygen -q -t ed25519 -N '' -C practice-cluster-host -f "$dir/ssh/host_key"
    ssh-keygen -q -t ed25519 -N '' -C practice-cluster-user -f "$dir/ssh/id_ed25519"
    cp "$dir/ssh/id_ed25519.pub" "$dir/ssh/authorized_keys"
    {
        for i in "${!nodes[@]}"; do printf 'Host %s\n    HostName 10.200.0.%d\n' "${nodes[$i]}" $((i + 1)); done
        # NOTE: a fresh host key on every up.sh: no known_hosts to keep, so no host key checking.
        printf 'Host *\n    User root\n    IdentityFile %s\n' "$dir/ssh/id_ed25519"
        printf '    IdentitiesOnly yes\n    BatchMode yes\n'
        printf '    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n    LogLevel ERROR\n'
    } >"$dir/ssh/config"
    for i in "${!nodes[@]}"; do
        node=${nodes[$i]}
        cat >"$dir/ssh/sshd_config-$node" <<CONF
ListenAddress 10.200.0.$((i + 1))
HostKey $dir/ssh/host_key
PidFile $dir/sshd-$node.pid
AuthorizedKeysFile $dir/ssh/authorized_keys
# NOTE: the state folder may sit in /tmp, which StrictModes rejects as a home for authorized_keys.
StrictModes no
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
PrintMotd no
PrintLastLog no
CONF
        # NOTE: started inside the node (its network, hostname and /etc/hosts), so ssh sessions get them too.
        PRACTICE_CLUSTER_DIR=$dir "$here/on-node.sh" "$node" /usr/sbin/sshd -f "$dir/ssh/sshd_config-$node"
    done
fi
trap - ERR
sinfo -N
echo "practice cluster up; state, logs and pid files in $dir"
echo "use it with:  source $dir/env.sh   (sets SLURM_CONF)"
if [[ -e $dir/ssh/config ]]; then echo "ssh to a node:  ssh -F $dir/ssh/config node1"; fi
