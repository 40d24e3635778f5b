(define (problem plan_trial_T20261122_100001_000001)
    (:domain alfred)
    (:objects
        agent1 - agent
        AppleType - otype
        CounterTopType - rtype
        FridgeType - rtype
        Apple_bar__minus_01_dot_50_bar__plus_00_dot_90_bar__plus_01_dot_20 - object
        CounterTop_bar__minus_01_dot_80_bar__plus_00_dot_90_bar__plus_01_dot_00 - receptacle
        Fridge_bar__plus_00_dot_50_bar__plus_00_dot_00_bar__minus_02_dot_00 - receptacle
        loc_bar__minus_7_bar_4_bar_3_bar_45 - location
        loc_bar_2_bar__minus_6_bar_2_bar_30 - location
        loc_bar_0_bar_0_bar_0_bar_30 - location
        )
    (:init
        (receptacleType CounterTop_bar__minus_01_dot_80_bar__plus_00_dot_90_bar__plus_01_dot_00 CounterTopType)
        (receptacleType Fridge_bar__plus_00_dot_50_bar__plus_00_dot_00_bar__minus_02_dot_00 FridgeType)
        (objectType Apple_bar__minus_01_dot_50_bar__plus_00_dot_90_bar__plus_01_dot_20 AppleType)
        (canContain CounterTopType AppleType)
        (canContain FridgeType AppleType)
        (openable Fridge_bar__plus_00_dot_50_bar__plus_00_dot_00_bar__minus_02_dot_00)
        (pickupable Apple_bar__minus_01_dot_50_bar__plus_00_dot_90_bar__plus_01_dot_20)
        (atLocation agent1 loc_bar_0_bar_0_bar_0_bar_30)
        (receptacleAtLocation CounterTop_bar__minus_01_dot_80_bar__plus_00_dot_90_bar__plus_01_dot_00 loc_bar__minus_7_bar_4_bar_3_bar_45)
        (receptacleAtLocation Fridge_bar__plus_00_dot_50_bar__plus_00_dot_00_bar__minus_02_dot_00 loc_bar_2_bar__minus_6_bar_2_bar_30)
        (inReceptacle Apple_bar__minus_01_dot_50_bar__plus_00_dot_90_bar__plus_01_dot_20 CounterTop_bar__minus_01_dot_80_bar__plus_00_dot_90_bar__plus_01_dot_00)
        (objectAtLocation Apple_bar__minus_01_dot_50_bar__plus_00_dot_90_bar__plus_01_dot_20 loc_bar__minus_7_bar_4_bar_3_bar_45)
        )
    (:goal
        (and
            (exists (?r - receptacle)
                (exists (?o - object)
                    (and
                        (inReceptacle ?o ?r)
                        (objectType ?o AppleType)
                        (receptacleType ?r FridgeType)
                    )
                )
            )
        )
    )
)
