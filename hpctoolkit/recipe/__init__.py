"""The recipe: the typed sections assembled into one `RecipeConfig` (`schema`), loading with
overrides (`load`), the rules across sections (`couplings`), which embedded default `make run`
takes (`defaults`), and a recipe's first samples as the trainer will see them (`preview`, a
command over a whole recipe: data, target and engine). Import the names from their modules; this
package init imports nothing.

Why a room of its own, above the sections, rather than vLLM's one config package: vLLM's sections
live in `vllm/config/`, but ours are owned by the rooms that use them (`data`, `engine`, `plan`,
`store`, `train`), and the rules across them need the draft families (`models`), the placement
and sizing (`plan`) and the target's config (`targets`). Putting the sections into `config/` would
move five files out of their rooms and still leave the cross-checks to import upward; here the
sections stay home on `config.fields` (the foundation, which imports nothing above it), and the
assembly sits above everything it reads, so every arrow into and out of it runs down.

Loading a recipe reads small files (the recipe, the draft config JSON, a target's `config.json`)
and writes none: a packaged target that is not converted yet is checked against its config once a
role or `submit` converts it (`couplings.check_target`).
"""
