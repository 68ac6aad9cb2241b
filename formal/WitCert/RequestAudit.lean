import WitCert.UnionBound
import Mathlib.Data.Finset.Max
import Mathlib.Data.Nat.Choose.Sum

/-!
# The request audit: an upper confidence bound on the number of cells above `τ`

A request's cells form a fixed population of `N`; `M` of them have total variation above `τ`.
The audit (`witcert.audit`) picks each cell independently with probability `r`, bounds each
picked cell (the deterministic meter, or a spot check at `δ_c`) and flags it when its bound
exceeds `τ`. Let `X` be the flagged count and `X'` the number of picked cells with total
variation above `τ`, so `X' ~ Binomial(M, r)` (the picks are independent of everything else).

1. On the event `F` that some picked cell's spot check fails, nothing is claimed; `F` has
   probability at most `δ_c ∑_i P(i picked) = δ_c E|P|` (union bound,
   `WitCert.measure_picked_fail_le`).
2. Off `F`, every picked cell with total variation above `τ` is flagged: `X' ≤ X`.
3. `M_upper(x) = max {m ≤ N | P(Binomial(m, r) ≤ x) ≥ δ_s}` is nondecreasing in `x`
   (`WitCert.auditUpper_mono`), so off `F`, `M_upper(X') ≤ M_upper(X)`.
4. `M_upper(X') < M` forces `P(Binomial(M, r) ≤ X') < δ_s`, the binomial cdf at the observed
   value below `δ_s`; a random variable's cdf at its own value is super-uniform,
   `P(F(X') < α) ≤ α` (`WitCert.measure_cdf_lt_le`, for any `ℕ`-valued variable whose cdf
   reaches `α`), so this has probability at most `δ_s`.

(An audit that bounds each picked cell by its true total variation has `F = ∅`:
`WitCert.measure_auditUpper_exact_le`.)

Hence `P(M_upper(X) < M) ≤ δ_s + δ_c E|P|` (`WitCert.measure_audit_le`): the reported
`M_upper(X) / N` bounds the share of cells above `τ` with that confidence. Assumed, not proved
here: that `X'` has the binomial law (its cdf is `WitCert.binomCdf M r`; independent picks of
probability `r` give it), and that the cells, hence `M`, do not depend on the audit's draws.

## Main definitions

* `WitCert.binomCdf m r x`: `∑_{j ≤ x} C(m, j) r^j (1 - r)^(m - j)`.
* `WitCert.auditUpper N r δs x`: `max {m ≤ N | δ_s ≤ binomCdf m r x}` (`0` if none).

## Main statements

* `WitCert.binomCdf_mono`, `WitCert.binomCdf_self`: the cdf is nondecreasing and reaches `1`.
* `WitCert.auditUpper_mono`: `M_upper` is nondecreasing.
* `WitCert.le_auditUpper`, `WitCert.binomCdf_lt_of_auditUpper_lt`: `M_upper(x) < m ≤ N` means
  `binomCdf m r x < δ_s`.
* `WitCert.measure_cdf_lt_le`: super-uniformity of a discrete cdf.
* `WitCert.measure_picked_fail_le`: the failures of picked cells, by the union bound.
* `WitCert.measure_auditUpper_lt_le`: `P(M_upper(X) < M) ≤ δ_s + P(F)`.
* `WitCert.measure_audit_le`: `P(M_upper(X) < M) ≤ δ_s + δ_c ∑_i P(i picked)`.
* `WitCert.measure_auditUpper_exact_le`: with exact bounds (`X' ≤ X` always), `P(M_upper(X) < M) ≤ δ_s`.
-/

open MeasureTheory
open scoped ENNReal

noncomputable section

namespace WitCert

/-- The binomial cdf `P(Binomial(m, r) ≤ x) = ∑_{j ≤ x} C(m, j) r^j (1 - r)^(m - j)`. -/
def binomCdf (m : ℕ) (r : ℝ) (x : ℕ) : ℝ :=
  ∑ j ∈ Finset.range (x + 1), (m.choose j : ℝ) * r ^ j * (1 - r) ^ (m - j)

/-- The audit's upper bound on the number of cells above `τ` after `x` flags:
`max {m ≤ N | δ_s ≤ P(Binomial(m, r) ≤ x)}`, `0` when no `m` qualifies. -/
def auditUpper (N : ℕ) (r δs : ℝ) (x : ℕ) : ℕ :=
  ((Finset.range (N + 1)).filter (fun m => δs ≤ binomCdf m r x)).sup id

/-- The binomial cdf is nondecreasing in `x` for `0 ≤ r ≤ 1` (its terms are nonnegative). -/
theorem binomCdf_mono (m : ℕ) {r : ℝ} (hr0 : 0 ≤ r) (hr1 : r ≤ 1) {x y : ℕ} (hxy : x ≤ y) :
    binomCdf m r x ≤ binomCdf m r y := by
  have hsub : Finset.range (x + 1) ⊆ Finset.range (y + 1) :=
    Finset.range_subset_range.mpr (by omega)
  have hterm : ∀ j ∈ Finset.range (y + 1), j ∉ Finset.range (x + 1) →
      0 ≤ (m.choose j : ℝ) * r ^ j * (1 - r) ^ (m - j) :=
    fun j _ _ => mul_nonneg (mul_nonneg (Nat.cast_nonneg _) (pow_nonneg hr0 j))
      (pow_nonneg (sub_nonneg.mpr hr1) (m - j))
  exact Finset.sum_le_sum_of_subset_of_nonneg hsub hterm

/-- The binomial cdf reaches `1` at `x = m` (the binomial theorem for `r + (1 - r) = 1`). -/
theorem binomCdf_self (m : ℕ) (r : ℝ) : binomCdf m r m = 1 := by
  have hone : r + (1 - r) = 1 := by ring
  calc binomCdf m r m
      = ∑ j ∈ Finset.range (m + 1), r ^ j * (1 - r) ^ (m - j) * (m.choose j : ℝ) :=
        Finset.sum_congr rfl fun j _ => by ring
    _ = (r + (1 - r)) ^ m := (add_pow r (1 - r) m).symm
    _ = 1 := by rw [hone, one_pow]

/-- **`M_upper` is nondecreasing.** More flags never lower the audit's upper bound: every `m`
that qualifies at `x` qualifies at `y ≥ x`, the cdf being nondecreasing. -/
theorem auditUpper_mono (N : ℕ) {r : ℝ} (δs : ℝ) (hr0 : 0 ≤ r) (hr1 : r ≤ 1) {x y : ℕ}
    (hxy : x ≤ y) : auditUpper N r δs x ≤ auditUpper N r δs y := by
  have hsub : (Finset.range (N + 1)).filter (fun m => δs ≤ binomCdf m r x)
      ⊆ (Finset.range (N + 1)).filter (fun m => δs ≤ binomCdf m r y) := by
    intro m hm
    rw [Finset.mem_filter] at hm ⊢
    exact ⟨hm.1, hm.2.trans (binomCdf_mono m hr0 hr1 hxy)⟩
  exact Finset.sup_mono hsub

/-- Every `m ≤ N` whose cdf at `x` is at least `δ_s` is at most `M_upper(x)`. -/
theorem le_auditUpper {N m : ℕ} {r δs : ℝ} {x : ℕ} (hm : m ≤ N) (h : δs ≤ binomCdf m r x) :
    m ≤ auditUpper N r δs x := by
  have hmem : m ∈ (Finset.range (N + 1)).filter (fun m => δs ≤ binomCdf m r x) :=
    Finset.mem_filter.mpr ⟨Finset.mem_range.mpr (by omega), h⟩
  exact Finset.le_sup (f := id) hmem

/-- `M_upper(x) < m ≤ N` means the cdf of `Binomial(m, r)` at `x` is below `δ_s`. -/
theorem binomCdf_lt_of_auditUpper_lt {N m : ℕ} {r δs : ℝ} {x : ℕ} (hm : m ≤ N)
    (h : auditUpper N r δs x < m) : binomCdf m r x < δs := by
  by_contra hnot
  exact absurd (le_auditUpper hm (not_lt.mp hnot)) (not_le.mpr h)

/-- **Super-uniformity of a discrete cdf.** For an `ℕ`-valued `Y` whose cdf
`x ↦ μ {Y ≤ x}` reaches `α` at some `n`, the cdf evaluated at `Y` itself is below `α` with
probability at most `α`: the values where the cdf is below `α` form an initial segment
`{0, …, x*}` with `x* < n`, so the event is `{Y ≤ x*}`, of probability `μ {Y ≤ x*} < α`. -/
theorem measure_cdf_lt_le {Ω : Type*} [MeasurableSpace Ω] (μ : Measure Ω) (Y : Ω → ℕ)
    {α : ℝ≥0∞} {n : ℕ} (hn : α ≤ μ {ω | Y ω ≤ n}) :
    μ {ω | μ {ω' | Y ω' ≤ Y ω} < α} ≤ α := by
  classical
  obtain ⟨S, hS⟩ : ∃ S : Finset ℕ,
      S = (Finset.range n).filter (fun x => μ {ω | Y ω ≤ x} < α) := ⟨_, rfl⟩
  have hS_mem : ∀ x, x ∈ S ↔ x < n ∧ μ {ω | Y ω ≤ x} < α := fun x => by
    rw [hS, Finset.mem_filter, Finset.mem_range]
  -- a value whose cdf is below `α` is below `n`, since the cdf reaches `α` at `n`
  have hmem : ∀ ω, μ {ω' | Y ω' ≤ Y ω} < α → Y ω ∈ S := by
    intro ω hω
    refine (hS_mem (Y ω)).mpr ⟨?_, hω⟩
    by_contra hge
    have hle : n ≤ Y ω := not_lt.mp hge
    have hsub : {ω' | Y ω' ≤ n} ⊆ {ω' | Y ω' ≤ Y ω} := by
      intro ω' hω'
      rw [Set.mem_setOf_eq] at hω' ⊢
      exact le_trans hω' hle
    exact absurd hω (not_lt.mpr (hn.trans (measure_mono hsub)))
  rcases Finset.eq_empty_or_nonempty S with hempty | hne
  · -- no value has its cdf below `α`: the event is empty
    have hnone : {ω | μ {ω' | Y ω' ≤ Y ω} < α} ⊆ ∅ := by
      intro ω hω
      rw [Set.mem_setOf_eq] at hω
      have hin := hmem ω hω
      rw [hempty] at hin
      exact absurd hin (Finset.notMem_empty (Y ω))
    calc μ {ω | μ {ω' | Y ω' ≤ Y ω} < α} ≤ μ ∅ := measure_mono hnone
      _ = 0 := measure_empty
      _ ≤ α := zero_le
  · -- the largest such value `x*`: the event lies in `{Y ≤ x*}`, whose probability is `< α`
    have htop : μ {ω | Y ω ≤ S.max' hne} < α := ((hS_mem _).mp (Finset.max'_mem S hne)).2
    have hsub : {ω | μ {ω' | Y ω' ≤ Y ω} < α} ⊆ {ω | Y ω ≤ S.max' hne} := by
      intro ω hω
      rw [Set.mem_setOf_eq] at hω ⊢
      exact Finset.le_max' S (Y ω) (hmem ω hω)
    calc μ {ω | μ {ω' | Y ω' ≤ Y ω} < α} ≤ μ {ω | Y ω ≤ S.max' hne} := measure_mono hsub
      _ ≤ α := le_of_lt htop

/-- **Failures of picked cells.** If cell `i`'s check fails while it is picked with probability
at most `δ_c P(i picked)`, some picked cell's check fails with probability at most
`δ_c ∑_i P(i picked)` (`= δ_c E|P|`). -/
theorem measure_picked_fail_le {Ω ι : Type*} [MeasurableSpace Ω] [Fintype ι] (μ : Measure Ω)
    (pick fail : ι → Set Ω) {δc : ℝ≥0∞} (hfail : ∀ i, μ (pick i ∩ fail i) ≤ δc * μ (pick i)) :
    μ (⋃ i, pick i ∩ fail i) ≤ δc * ∑ i, μ (pick i) := by
  rw [Finset.mul_sum]
  exact measure_iUnion_le_of_sum_le μ (fun i => pick i ∩ fail i) _ hfail le_rfl

/-- **The audit's combination.** Let `M ≤ N` cells have total variation above `τ`, `X` be the
flagged count and `X'` the number of picked cells above `τ`, with `X' ≤ X` off an event `F`
and `X' ~ Binomial(M, r)` (`μ {X' ≤ x} = binomCdf M r x`). Then
`P(M_upper(X) < M) ≤ δ_s + P(F)`. -/
theorem measure_auditUpper_lt_le {Ω : Type*} [MeasurableSpace Ω] (μ : Measure Ω) {N M : ℕ}
    (hM : M ≤ N) {r δs : ℝ} (hr0 : 0 ≤ r) (hr1 : r ≤ 1) (hδs : 0 < δs) (hδs1 : δs ≤ 1)
    (X X' : Ω → ℕ) (F : Set Ω) (hflag : ∀ ω, ω ∉ F → X' ω ≤ X ω)
    (hlaw : ∀ x, μ {ω | X' ω ≤ x} = ENNReal.ofReal (binomCdf M r x)) :
    μ {ω | auditUpper N r δs (X ω) < M} ≤ ENNReal.ofReal δs + μ F := by
  -- off `F`, `M_upper(X') ≤ M_upper(X)`: a miss of `M_upper(X)` is a miss of `M_upper(X')`
  have hsplit : {ω | auditUpper N r δs (X ω) < M}
      ⊆ F ∪ {ω | auditUpper N r δs (X' ω) < M} := by
    intro ω hω
    rw [Set.mem_setOf_eq] at hω
    by_cases hF : ω ∈ F
    · exact Set.mem_union_left _ hF
    · refine Set.mem_union_right _ ?_
      rw [Set.mem_setOf_eq]
      exact lt_of_le_of_lt (auditUpper_mono N δs hr0 hr1 (hflag ω hF)) hω
  -- a miss of `M_upper(X')` puts the binomial cdf at `X'` below `δ_s`
  have hcdf : {ω | auditUpper N r δs (X' ω) < M}
      ⊆ {ω | μ {ω' | X' ω' ≤ X' ω} < ENNReal.ofReal δs} := by
    intro ω hω
    rw [Set.mem_setOf_eq] at hω ⊢
    rw [hlaw (X' ω)]
    exact (ENNReal.ofReal_lt_ofReal_iff hδs).mpr (binomCdf_lt_of_auditUpper_lt hM hω)
  -- the cdf of `Binomial(M, r)` reaches `1 ≥ δ_s` at `M`
  have hreach : ENNReal.ofReal δs ≤ μ {ω | X' ω ≤ M} := by
    rw [hlaw M, binomCdf_self]
    exact ENNReal.ofReal_le_ofReal hδs1
  have hmiss : μ {ω | auditUpper N r δs (X' ω) < M} ≤ ENNReal.ofReal δs :=
    (measure_mono hcdf).trans (measure_cdf_lt_le μ X' hreach)
  calc μ {ω | auditUpper N r δs (X ω) < M}
      ≤ μ (F ∪ {ω | auditUpper N r δs (X' ω) < M}) := measure_mono hsplit
    _ ≤ μ F + μ {ω | auditUpper N r δs (X' ω) < M} := measure_union_le (μ := μ) _ _
    _ ≤ μ F + ENNReal.ofReal δs := add_le_add le_rfl hmiss
    _ = ENNReal.ofReal δs + μ F := add_comm _ _

/-- **The exact audit.** When every picked cell's bound is its true total variation (rounded up),
a picked cell above `τ` is always flagged: `X' ≤ X` on every outcome, no check can fail, and
`P(M_upper(X) < M) ≤ δ_s`: the whole `δ` goes to the binomial limit. -/
theorem measure_auditUpper_exact_le {Ω : Type*} [MeasurableSpace Ω] (μ : Measure Ω) {N M : ℕ}
    (hM : M ≤ N) {r δs : ℝ} (hr0 : 0 ≤ r) (hr1 : r ≤ 1) (hδs : 0 < δs) (hδs1 : δs ≤ 1)
    (X X' : Ω → ℕ) (hflag : ∀ ω, X' ω ≤ X ω)
    (hlaw : ∀ x, μ {ω | X' ω ≤ x} = ENNReal.ofReal (binomCdf M r x)) :
    μ {ω | auditUpper N r δs (X ω) < M} ≤ ENNReal.ofReal δs := by
  -- the event `F` of a failed check is empty
  have h := measure_auditUpper_lt_le μ hM hr0 hr1 hδs hδs1 X X' ∅ (fun ω _ => hflag ω) hlaw
  rwa [measure_empty, add_zero] at h

/-- **The request audit.** With picks `pick i`, check failures `fail i` (each at most
`δ_c P(i picked)` while picked), `X' ≤ X` whenever no picked cell's check fails, and
`X' ~ Binomial(M, r)`: `P(M_upper(X) < M) ≤ δ_s + δ_c ∑_i P(i picked)`. -/
theorem measure_audit_le {Ω ι : Type*} [MeasurableSpace Ω] [Fintype ι] (μ : Measure Ω)
    {N M : ℕ} (hM : M ≤ N) {r δs : ℝ} (hr0 : 0 ≤ r) (hr1 : r ≤ 1) (hδs : 0 < δs)
    (hδs1 : δs ≤ 1) (pick fail : ι → Set Ω) {δc : ℝ≥0∞}
    (hfail : ∀ i, μ (pick i ∩ fail i) ≤ δc * μ (pick i)) (X X' : Ω → ℕ)
    (hflag : ∀ ω, ω ∉ ⋃ i, pick i ∩ fail i → X' ω ≤ X ω)
    (hlaw : ∀ x, μ {ω | X' ω ≤ x} = ENNReal.ofReal (binomCdf M r x)) :
    μ {ω | auditUpper N r δs (X ω) < M} ≤ ENNReal.ofReal δs + δc * ∑ i, μ (pick i) :=
  (measure_auditUpper_lt_le μ hM hr0 hr1 hδs hδs1 X X' _ hflag hlaw).trans
    (add_le_add le_rfl (measure_picked_fail_le μ pick fail hfail))

end WitCert

end
