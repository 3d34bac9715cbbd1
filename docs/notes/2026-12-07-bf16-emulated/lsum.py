import json,re,sys
txt=open(sys.argv[1]).read()
parts=re.split(r'^(== .*)$', txt, flags=re.M)
for i in range(1,len(parts),2):
    body=parts[i+1].strip()
    if not body: continue
    j=json.loads(body); h=j['hybridmoe']; l=j['llama.cpp']
    print(parts[i][3:45], f"prefill {h['prefill_tps']:.0f}/{l['prefill_tps']:.0f} {j['prefill_ratio']:.2f}x  decode {h['decode_tps']:.1f}/{l['decode_tps']:.1f} {j['decode_ratio']:.2f}x  roof {j['roofline_tps']:.0f} {h['roofline_pct']:.0f}%/{l['roofline_pct']:.0f}%  bw {j['read_bandwidth_gbs']:.1f}  rss {h['peak_rss']/1e9:.2f}/{l['peak_rss']/1e9:.2f}  same {j['same_tokens']}  runs {[round(x,1) for x in h['decode_runs']]} {[round(x,1) for x in l['decode_runs']]}")
