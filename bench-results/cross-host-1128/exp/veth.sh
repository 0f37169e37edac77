set -e
ip netns add mqx-a; ip netns add mqx-b
ip link add mqx-va type veth peer name mqx-vb
ip link set mqx-va netns mqx-a; ip link set mqx-vb netns mqx-b
ip -n mqx-a addr add 10.211.0.1/24 dev mqx-va; ip -n mqx-b addr add 10.211.0.2/24 dev mqx-vb
ip -n mqx-a link set mqx-va up; ip -n mqx-b link set mqx-vb up
ip -n mqx-a link set lo up; ip -n mqx-b link set lo up
# tear down: ip netns del mqx-a; ip netns del mqx-b (the veth pair goes with them)
