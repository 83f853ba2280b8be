"""TEMPORARY stub (helper writes the real one)."""
from __future__ import annotations
from pathlib import Path
import torch


def load_gemma_tokenizer(folder):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(folder))


def load_gemma_text_encoder(folder, dtype, device):
    from transformers import AutoModel
    return AutoModel.from_pretrained(str(folder), torch_dtype=dtype).to(device).eval()


class GemmaPromptEncoder:
    def __init__(self, tokenizer, model, max_sequence_length: int = 1024):
        self.tokenizer, self.model, self.max_sequence_length = tokenizer, model, max_sequence_length

    def encode(self, prompt: str):
        tok = self.tokenizer
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        t = tok([prompt.strip()], padding="max_length", max_length=self.max_sequence_length, truncation=True,
                add_special_tokens=True, return_tensors="pt")
        dev = next(self.model.parameters()).device
        out = self.model(input_ids=t.input_ids.to(dev), attention_mask=t.attention_mask.to(dev), output_hidden_states=True)
        return torch.stack(out.hidden_states, dim=-1), t.attention_mask.to(dev)
