"""Multi-LoRA serving's choreography in the engine: adapters loaded into, updated in and unloaded from the slots of
the LoRA bank the runner's weights hold (`jaxgen.model.lora.Bank`), between steps and without recompiling.

`AdapterControl` is a part of `Engine` (its methods use the engine's locks, scheduler and runner): the adapter
names (`jaxgen.inference.adapters.LoraRegistry`) and when a slot may be written or reused.
"""

from __future__ import annotations

from jaxgen.inference.adapters import LoraError, read_adapter_folder
from jaxgen.model import lora


class AdapterControl:
    """`Engine`'s adapter methods; see the module docstring."""

    def load_lora(self, name: str, adapters: dict, scale: float = 1.0, replace: bool = False) -> None:
        """Loads adapters ({target: {"a_..": (L, *in, r), "b_..": (L, r, *out)}}, `jaxgen.model.lora`'s layout)
        as `name`, their product scaled by `scale` (alpha / rank), into a free slot of the bank: a jitted write,
        nothing recompiles. LoraError (a ValueError) when it does not fit: no free slot (serve.max_loras), a
        rank above serve.max_lora_rank, a target the bank lacks, shapes of another model, a NaN weight, a name
        in use. `replace`: a loaded `name` is replaced at once (its slot reused when no running request holds
        it); on any error the old adapter stays loaded as it was."""
        entry = self._bank_entry(name, adapters, scale, "load")
        with self._exclusive:  # no step runs meanwhile (it would read the donated bank), nor another load
            with self.lock:
                ref = self.loras.reserve(name, self._lora_slots_in_use(), replace)
                if replace and name in self.loras.loaded:  # the swap is atomic: no request sees its slot half-new
                    self.runner.write_bank_entry(ref.slot, entry)
                    self.loras.add(ref)
                    return
            self.runner.write_bank_entry(ref.slot, entry)
            with self.lock:
                self.loras.add(ref)  # requests may name it from now on

    def update_lora(self, name: str, adapters: dict, scale: float = 1.0) -> None:
        """New weights for the loaded adapter `name` (reinforcement learning's LoRA-only swap), written into its
        slot by `load_lora`'s jitted write with the bank donated: in place, nothing recompiles, the base and the
        other slots untouched. As `update_params`: sequences in flight are preempted and recomputed on the new
        weights, the prefix cache emptied. LoraNotFound when `name` is not loaded; LoraError when it does not fit."""
        entry = self._bank_entry(name, adapters, scale, "update")
        with self._exclusive:  # no step reads the bank meanwhile; an unload cannot free the slot under us
            with self.lock:
                ref = self.loras.resolve(name)
            self._preempt_all(same_weights=False)
            self.runner.write_bank_entry(ref.slot, entry)

    def _bank_entry(self, name: str, adapters: dict, scale: float, verb: str):
        """The bank slot's contents for `adapters` (host arrays), or LoraError saying why they do not fit."""
        bank = lora.bank_of(self.runner.params)
        if bank is None:
            raise LoraError("this engine serves no LoRA adapters: start it with serve.max_loras > 0")
        try:
            return lora.bank_entry(adapters, scale, bank)
        except ValueError as e:
            raise LoraError(f"cannot {verb} lora_name={name!r}: {e}") from None

    def load_lora_folder(self, name: str, folder, replace: bool = False) -> None:
        """`load_lora` of a PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`); with
        `replace`, the folder is read and checked before the loaded `name` is replaced."""
        with self.lock:
            if name in self.loras.loaded and not replace:  # before reading the folder
                raise LoraError(f"lora_name={name!r} is loaded already: unload it first (or load it in place)")
        adapters, scale = read_adapter_folder(folder, self.cfg)
        self.load_lora(name, adapters, scale, replace)

    def unload_lora(self, name: str) -> None:
        """New requests cannot name `name` any more (LoraNotFound if not loaded); requests already using it
        finish with it, and its slot is reused only once they are done."""
        with self.lock:
            self.loras.remove(name)

    def lora_names(self) -> list[str]:
        """The adapters loaded, in load order."""
        with self.lock:
            return self.loras.names()

    def _lora_slots_in_use(self) -> set[int]:
        live = [*self.scheduler.waiting, *self.scheduler.prefilling, *self.scheduler.slots]
        return {r.lora.slot for r in live if r is not None and r.lora is not None}
