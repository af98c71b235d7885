"""The serving engine contract, as data: what each SGLang release does with a draft, and the problem codes a check can report."""
