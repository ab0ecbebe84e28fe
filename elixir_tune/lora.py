"""LoRA through PEFT, under the path the README documented first (``from elixir_tune.lora import apply_lora,
save_adapter, save_merged``): scripts written against it keep working. The module is
``elixir_tune.models.lora``; import it from there."""

from elixir_tune.models.lora import LoraError, apply_lora, lora_settings, merged_state_dict, save_adapter, save_merged

__all__ = ["LoraError", "apply_lora", "lora_settings", "merged_state_dict", "save_adapter", "save_merged"]
