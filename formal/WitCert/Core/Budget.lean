/-!
# Budget composition over an abstract ordered additive monoid, in core Lean

The request-level failure budget (Lemma 3, registry key `L3`) composes local budgets:
if each of `n` failure probabilities is at most `δ_loc` and `n • δ_loc ≤ δ_req`, then their sum
is at most `δ_req`. The union bound that turns "probability of any failure" into that sum is the
measure-theoretic half (`WitCert.measure_iUnion_le_budget`); this file is the order-theoretic half,
stated for any additive structure with a compatible preorder and checked with nothing but core
Lean.

## Main definitions

* `WitCert.Core.BudgetMonoid`: addition, zero and a preorder with monotone addition.
* `WitCert.Core.BudgetMonoid.lsum`, `WitCert.Core.BudgetMonoid.nsmul`: list sum and `n • a`.

## Main statements

* `WitCert.Core.BudgetMonoid.lsum_le_nsmul`: a list of budgets each `≤ δ` sums to `≤ length • δ`.
* `WitCert.Core.BudgetMonoid.budget_composition`: with `length • δ_loc ≤ δ_req`, the sum is
  `≤ δ_req`.
-/

namespace WitCert.Core

/-- An additive structure with a preorder for which addition is monotone in both arguments. -/
structure BudgetMonoid (α : Type) where
  /-- Addition. -/
  add : α → α → α
  /-- The neutral element. -/
  zero : α
  /-- The order. -/
  le : α → α → Prop
  /-- Reflexivity. -/
  le_refl : ∀ a, le a a
  /-- Transitivity. -/
  le_trans : ∀ a b c, le a b → le b c → le a c
  /-- Addition is monotone. -/
  add_le_add : ∀ a b c d, le a b → le c d → le (add a c) (add b d)

namespace BudgetMonoid

variable {α : Type} (M : BudgetMonoid α)

/-- The sum of a list. -/
def lsum : List α → α
  | [] => M.zero
  | a :: l => M.add a (lsum l)

/-- `n • a`, the sum of `n` copies of `a`. -/
def nsmul : Nat → α → α
  | 0, _ => M.zero
  | n + 1, a => M.add a (nsmul n a)

/-- Every entry at most `δ` gives a sum at most `length • δ`. -/
theorem lsum_le_nsmul (δ : α) :
    ∀ l : List α, (∀ x, x ∈ l → M.le x δ) → M.le (M.lsum l) (M.nsmul l.length δ)
  | [], _ => M.le_refl M.zero
  | a :: l, h =>
    M.add_le_add _ _ _ _ (h a (List.Mem.head l))
      (lsum_le_nsmul δ l fun x hx => h x (List.Mem.tail a hx))

/-- Budget composition: local budgets `δ_loc` with `length • δ_loc ≤ δ_req` sum to `≤ δ_req`. -/
theorem budget_composition (δloc δreq : α) (l : List α) (h : ∀ x, x ∈ l → M.le x δloc)
    (hbudget : M.le (M.nsmul l.length δloc) δreq) : M.le (M.lsum l) δreq :=
  M.le_trans _ _ _ (M.lsum_le_nsmul δloc l h) hbudget

end BudgetMonoid

end WitCert.Core
