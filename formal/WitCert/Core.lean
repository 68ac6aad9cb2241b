import WitCert.Core.Factorial
import WitCert.Core.Budget
import WitCert.Core.Refinement

/-!
# The dependency-free layer

Statements that need nothing beyond core Lean: the factorial comparison behind Lemma 2, budget
composition (Lemma 3) and the refinement identity (Lemma 4). Build with `lake build WitCertCore`,
or check each file with `lean` alone.
-/
