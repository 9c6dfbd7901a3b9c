#!/bin/bash
# ship runs/dense6/final as models/turbospec-tiny; the session-3 hybrid moves to models/turbospec-tiny-hybrid
set -ex
cd "$(dirname "$0")/../.."  # the repository root
git mv models/turbospec-tiny models/turbospec-tiny-hybrid
sed -i -E 's#models/turbospec-tiny([^-]|$)#models/turbospec-tiny-hybrid\1#g' models/turbospec-tiny-hybrid/README.md models/turbospec-tiny-hybrid/medusa_config.json
mkdir -p models/turbospec-tiny
bash training/recipes/ship.sh dense6   # weights, tokenizer, summary, eval.json, draft vocabulary
cmp models/turbospec-tiny/draft_vocab.json models/turbospec-tiny-hybrid/draft_vocab.json && echo "draft vocab identical to the hybrid's (same tokenizer, same training split)"
