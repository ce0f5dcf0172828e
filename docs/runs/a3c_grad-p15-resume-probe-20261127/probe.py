"""python probe.py BEST_PT LR: what 120 envs starting new games at once (as after --resume) do to a
trained a3c_grad network. Loads BEST_PT's network, plays 300 steps of 120 envs to spread the games,
warms Adam (lr LR, the script's eps) with 60 steps of 480 samples, then takes 30 steps from that state twice:
(a) the games going on, (b) 120 new games. Prints the share of the body's features that are positive
on some of 240 fixed Pong states, the policy's entropy and the values' spread on them, and per step
the gradient's norm before clipping, the mean advantage and the value loss."""
import copy, os, sys
import numpy as np, torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))   # the project's root
import a3c_grad, common
torch.manual_seed(0); torch.set_num_threads(2)
LR = float(sys.argv[2])
best = torch.load(sys.argv[1], weights_only=False)
cpu = torch.device("cpu")
P = a3c_grad.HYPERPARAMS["pong"]   # gamma, reward steps, entropy beta, clipping and Adam's eps: the script's

def source(net, seed):
    env = common.make_fast_env("pong", 120, threads=2)
    return iter(common.ExperienceSourceFirstLast(env, lambda s: a3c_grad.select_actions(net, s, cpu), P["gamma"],
                                                 P["reward_steps"], seed=seed))

def batch(it):
    exps = []
    while len(exps) < 480:
        exps.extend(next(it))
    return exps

def train(net, opt, it):
    states, actions, refs = common.unpack_batch_a2c(batch(it), net, "cpu", P["gamma"])
    opt.zero_grad()
    loss, stats = a3c_grad.calc_loss_a2c(net, states, actions, refs, P["entropy_beta"])
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), P["clip_grad"])
    opt.step()
    return round(float(norm), 3), round(float(stats["advantage"]), 4), round(float(stats["loss_value"]), 4)

probe_env = common.make_fast_env("pong", 8, threads=1)
obs, _ = probe_env.reset(seed=3); probe = []
rng = np.random.default_rng(0)
for i in range(300):
    obs, *_ = probe_env.step(rng.integers(0, 6, 8)); probe.append(obs.copy())
probe = torch.as_tensor(np.concatenate(probe[::10]))

def report(tag, net, extra=""):
    with torch.no_grad():
        f = net.body(probe.float() / 255); logits, v = net(probe)
    p = torch.softmax(logits, 1)
    print(f"{tag}: alive {(f > 0).any(0).float().mean():.3f} entropy {-(p * p.log()).sum(1).mean():.3f} "
          f"value std {v.std():.3f} {extra}", flush=True)

net = a3c_grad.A2C(probe_env.single_observation_space.shape, probe_env.single_action_space.n); net.load_state_dict(best["state_dict"])
opt = torch.optim.Adam(net.parameters(), lr=LR, eps=P["adam_eps"])
it = source(net, 1000)
for _ in range(300):   # desynchronize the games before any training
    next(it)
report("start", net)
for i in range(60):
    info = train(net, opt, it)
    if i % 20 == 19: report(f"warm {i + 1}", net, info)
saved_net, saved_opt = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
for arm in ("games go on", "all envs reset"):
    net.load_state_dict(saved_net); opt.load_state_dict(copy.deepcopy(saved_opt))
    run_it = it if arm == "games go on" else source(net, 2000)
    for i in range(30):
        info = train(net, opt, run_it)
        if i % 5 == 4: report(f"{arm} {i + 1}", net, info)
