/-!
# The refinement identity over abstract sums, in core Lean

Lemma 4 (registry key `L4`): when every token of a block carries its block's radius, the blockwise
mass `∑_blocks (∑_{t ∈ block} p_t) · g_block` equals the per-token mass
`∑_t p_t · g_{block(t)}`. Only associativity of addition, a zero, and right distributivity are
used, so the statement is made for any such structure and checked with nothing but core Lean.

## Main definitions

* `WitCert.Core.SumRing`: the operations and the four laws the identity needs.
* `WitCert.Core.SumRing.blockSum`: `∑_blocks (∑ masses) * g`.
* `WitCert.Core.SumRing.tokens`: the per-token terms `p_t * g_{block(t)}`, block by block.

## Main statements

* `WitCert.Core.SumRing.block_sum_eq_token_sum`: blockwise sum equals the per-token sum.
-/

namespace WitCert.Core

/-- Addition and multiplication with the laws the refinement identity uses. -/
structure SumRing (α : Type) where
  /-- Addition. -/
  add : α → α → α
  /-- Multiplication. -/
  mul : α → α → α
  /-- The additive neutral element. -/
  zero : α
  /-- Associativity of addition. -/
  add_assoc : ∀ a b c, add (add a b) c = add a (add b c)
  /-- Zero is a left identity. -/
  zero_add : ∀ a, add zero a = a
  /-- Right distributivity. -/
  add_mul : ∀ a b c, mul (add a b) c = add (mul a c) (mul b c)
  /-- Zero annihilates on the left. -/
  zero_mul : ∀ a, mul zero a = zero

namespace SumRing

variable {α : Type} (R : SumRing α)

/-- The sum of a list. -/
def lsum : List α → α
  | [] => R.zero
  | a :: l => R.add a (lsum l)

/-- Blockwise sum: each block is its token masses and its factor `g = exp (radius)`. -/
def blockSum (bs : List (List α × α)) : α :=
  R.lsum (bs.map fun b => R.mul (R.lsum b.1) b.2)

/-- Per-token terms `p_t * g_{block(t)}`, listed block by block. -/
def tokens : List (List α × α) → List α
  | [] => []
  | (ms, g) :: bs => ms.map (fun m => R.mul m g) ++ tokens bs

/-- The sum over a concatenation is the sum of the sums. -/
theorem lsum_append : ∀ l₁ l₂ : List α, R.lsum (l₁ ++ l₂) = R.add (R.lsum l₁) (R.lsum l₂)
  | [], l₂ => (R.zero_add (R.lsum l₂)).symm
  | a :: l₁, l₂ => by
    show R.add a (R.lsum (l₁ ++ l₂)) = R.add (R.add a (R.lsum l₁)) (R.lsum l₂)
    rw [lsum_append l₁ l₂, R.add_assoc]

/-- A common right factor comes out of a sum. -/
theorem lsum_mul (g : α) :
    ∀ l : List α, R.mul (R.lsum l) g = R.lsum (l.map fun x => R.mul x g)
  | [] => R.zero_mul g
  | a :: l => by
    show R.mul (R.add a (R.lsum l)) g = R.add (R.mul a g) (R.lsum (l.map fun x => R.mul x g))
    rw [R.add_mul, lsum_mul g l]

/-- Refinement (Lemma 4): the blockwise sum equals the per-token sum. -/
theorem block_sum_eq_token_sum : ∀ bs : List (List α × α), R.blockSum bs = R.lsum (R.tokens bs)
  | [] => rfl
  | (ms, g) :: bs => by
    show R.add (R.mul (R.lsum ms) g) (R.blockSum bs)
      = R.lsum (ms.map (fun m => R.mul m g) ++ R.tokens bs)
    rw [R.lsum_append, ← R.lsum_mul, block_sum_eq_token_sum bs]

end SumRing

end WitCert.Core
