"""ALQ: adaptive levels by exact coordinate descent on V(ℓ; F); ALQ-G by clipped gradient steps.

Spec: ``docs/quantizers.md`` §7 (paper arXiv 2010.12460). The objective is the closed-form expected
variance V(ℓ; F) = Σ_j S(ℓ_j, ℓ_{j+1}) of §6 with ℓ_0 = −1 and ℓ_{N−1} = 1 fixed, for any
``model.Distribution`` F (the truncated-normal mixture or the empirical histogram).

* ``problem``: free variables ↔ tables (also the symmetric, folded form), V, ∇V, the
  tridiagonal ∇²V, and the per-level problem of §7.1 with its guards;
* ``normal_updates`` / ``histogram_updates``: the exact §7.1 update on each family (iterated
  root finding on the mixture's smooth cdf; a closed-form solve in one bin of the histogram);
* ``sweeps``: Gauss–Seidel sweeps over the levels — exact coordinate descent, and ALQ-G (§7.3);
* ``descent``: the descent from a batch of starts, plain sweeps accelerated by damped Newton
  steps, and its stop rule (§7.2);
* ``starts``: the §7.2 initializations (quantiles, U-ref, E-ref, companding, ``initial``);
* ``relocation``: one-level relocation moves across gaps (``relocate=True``);
* ``fit``: the public ``fit_alq``, ``fit_alq_gd`` and ``alq_descent``.
"""

from horovod_aq.levels.alq.descent import MOVE_TOL
from horovod_aq.levels.alq.fit import alq_descent, fit_alq, fit_alq_gd
from horovod_aq.levels.alq.problem import MIN_INTERVAL_MASS, NEGLIGIBLE_GAIN
from horovod_aq.levels.alq.relocation import RELOCATE_CANDIDATES, RELOCATE_ROUNDS
from horovod_aq.levels.alq.starts import alq_initializations

__all__ = [
    "MIN_INTERVAL_MASS",
    "MOVE_TOL",
    "NEGLIGIBLE_GAIN",
    "RELOCATE_CANDIDATES",
    "RELOCATE_ROUNDS",
    "alq_descent",
    "alq_initializations",
    "fit_alq",
    "fit_alq_gd",
]
