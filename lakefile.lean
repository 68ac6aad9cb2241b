import Lake
open Lake DSL

/-! Lean 4 development of WitCert (docs/design.md "Verification chain"): `formal/WitCert/**`.

* `lake build WitCertCore`: the dependency-free layer (core Lean only, seconds).
* `lake build`: everything, against Mathlib at the tag matching the toolchain.
* `lake env lean formal/Export.lean`: statements and axioms of every registered theorem.
-/

package «witcert» where
  leanOptions := #[
    ⟨`autoImplicit, false⟩,
    ⟨`relaxedAutoImplicit, false⟩
  ]

require mathlib from git
  "https://github.com/leanprover-community/mathlib4" @ "v4.31.0"

/-- Core Lean only: the factorial comparison, budget composition and refinement identity. -/
lean_lib WitCertCore where
  srcDir := "formal"
  roots := #[`WitCert.Core]

/-- The Mathlib layer: every theorem registered in `spec/registry.py`. -/
@[default_target]
lean_lib WitCert where
  srcDir := "formal"
  roots := #[`WitCert]
