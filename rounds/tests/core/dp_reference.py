"""Reference ε values for fedfleet's RDP accountant (rounds/src/privacy.rs), from Google's
dp-accounting (PyPI `dp-accounting`): the Poisson-sampled Gaussian mechanism (sampling rate q,
noise multiplier z) composed over `steps` rounds, ε at δ = 1e-5.

    pip install dp-accounting && python3 rounds/tests/core/dp_reference.py > rounds/tests/core/dp_reference.csv

Two columns: `epsilon` is dp-accounting's RdpAccountant on fedfleet's orders (every integer
2..=64, then 80, 96, 128, 160, 192, 256, 384, 512, 768, 1024), the same computation, which
`rounds/tests/core/privacy.rs` checks within 1 % relative; `epsilon_default_orders` is the same
accountant on its default orders (fractional orders 1.1..10.9, integers 11..63, 128..1024), for
reading: fedfleet's bound is the looser (larger ε) where the best order is fractional, and the
tighter where it lies between 64 and 1024 off dp-accounting's ladder.
"""
import logging

import dp_accounting
from dp_accounting.rdp import RdpAccountant

logging.disable(logging.WARNING)  # dp-accounting warns for every fractional order it drops
DELTA = 1e-5
FEDFLEET_ORDERS = list(range(2, 65)) + [80, 96, 128, 160, 192, 256, 384, 512, 768, 1024]


def epsilon(q, z, steps, orders=None):
    acc = RdpAccountant(orders) if orders else RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z))
    acc.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return acc.get_epsilon(DELTA)


print(f"# dp-accounting RdpAccountant, delta = {DELTA}")
print("q,z,steps,epsilon,epsilon_default_orders")
for q in [0.001, 0.01, 0.05, 0.1, 0.3, 1.0]:
    for z in [0.6, 0.8, 1.0, 1.5, 2.5, 5.0]:
        for steps in [1, 10, 100, 1000, 10000]:
            print(f"{q},{z},{steps},{epsilon(q, z, steps, FEDFLEET_ORDERS):.10g},{epsilon(q, z, steps):.10g}")
