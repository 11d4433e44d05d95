"""Hugging Face engines: transformers models, batched decoding with frame KV reuse, grammar-constrained sampling,
MiniCPM-o.

- engines: `decoding_engine` (what they share), `engine` (families transformers supports natively), `minicpmo`
  (MiniCPM-o 4.5; `minicpmo_loading` loads its own code);
- decoding: `batch_decode` (the continuous decode loop), `model_forward` (every forward through the model),
  `row_prefill` (one row's prefill with frame reuse), `prefill_together` (cold rows in one forward), `cache_ops`,
  `frame_cache`, `sampling`, `text_path`, `text_stream`;
- grammars: `grammar` (compiling a request's schema), `grammar_batch` (the masks of one decode), `token_mask`;
- loading: `loading`, `model_files`, `minicpmv`; preparing: `preprocess`, `packed_images`, `special_tokens`.
"""
