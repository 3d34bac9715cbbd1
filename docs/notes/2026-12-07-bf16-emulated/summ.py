import json,re,sys
txt=open(sys.argv[1]).read()
parts=re.split(r'^(== .*)$', txt, flags=re.M)
for i in range(1,len(parts),2):
    try: j=json.loads(parts[i+1].strip())
    except Exception: print(parts[i], 'ERR', parts[i+1][:200]); continue
    h=j['hybridmoe']
    print(parts[i][:50], 'prefill', round(h['prefill_tps'],1), 'decode', round(h['decode_tps'],1), 'peak_rss MB', j['memory']['peak_rss']//2**20)
