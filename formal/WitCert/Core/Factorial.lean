/-!
# A factorial inequality, in core Lean

This file imports nothing but the Lean prelude, so it checks in seconds with a bare toolchain
(`lean formal/WitCert/Core/Factorial.lean`).

## Main definitions

* `WitCert.Core.fact`: the factorial, defined here because core Lean has none.

## Main statements

* `WitCert.Core.six_pow_mul_fact_le`: `6 ^ n * n! ≤ (2 n + 1)!`, the termwise comparison behind
  Lemma 2's `sinh x ≤ x * exp (x ^ 2 / 6)` (registry key `L2s`).
-/

namespace WitCert.Core

/-- The factorial `n!`, by structural recursion. -/
def fact : Nat → Nat
  | 0 => 1
  | n + 1 => (n + 1) * fact n

/-- The defining recursion of `fact`. -/
theorem fact_succ (n : Nat) : fact (n + 1) = (n + 1) * fact n := rfl

/-- The step factor: `6 (n + 1) ≤ (2 n + 3) (2 n + 2)`. -/
theorem six_mul_succ_le (n : Nat) : 6 * (n + 1) ≤ (2 * n + 1 + 1 + 1) * (2 * n + 1 + 1) := by
  have h : 6 * (n + 1) = 3 * (2 * n + 1 + 1) := by omega
  rw [h]
  exact Nat.mul_le_mul (by omega) (Nat.le_refl _)

/-- `6 ^ n * n! ≤ (2 n + 1)!`: each odd-factorial step multiplies by at least `6 (n + 1)`. -/
theorem six_pow_mul_fact_le : ∀ n : Nat, 6 ^ n * fact n ≤ fact (2 * n + 1)
  | 0 => by decide
  | n + 1 => by
    have ih := six_pow_mul_fact_le n
    have h3 : 2 * (n + 1) + 1 = 2 * n + 1 + 1 + 1 := by omega
    rw [h3, fact_succ (2 * n + 1 + 1), fact_succ (2 * n + 1), fact_succ n, Nat.pow_succ]
    calc 6 ^ n * 6 * ((n + 1) * fact n)
        = (6 * (n + 1)) * (6 ^ n * fact n) := by
          rw [Nat.mul_comm (6 ^ n) 6, Nat.mul_assoc 6 (6 ^ n), Nat.mul_left_comm (6 ^ n) (n + 1),
            ← Nat.mul_assoc 6 (n + 1)]
      _ ≤ ((2 * n + 1 + 1 + 1) * (2 * n + 1 + 1)) * fact (2 * n + 1) :=
          Nat.mul_le_mul (six_mul_succ_le n) ih
      _ = (2 * n + 1 + 1 + 1) * ((2 * n + 1 + 1) * fact (2 * n + 1)) := Nat.mul_assoc _ _ _

end WitCert.Core
